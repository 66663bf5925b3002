//! `pagewire bench pages`: KV page transfers between two engines, driven by real
//! `pagewire_layout` plans.
//!
//! The initiator (client) owns one pool, the server the other. One page mapping is
//! drawn per run (from `--pattern` and `--seed`), turned into a coalesced transfer plan
//! once, and that plan is submitted `-n` times as one batch each, with up to `-t`
//! batches in flight. With `--verify` the receiving side regenerates the source pool
//! from the seed, replays the plan with memcpy into a copy of its own pool, and
//! compares every byte of the pool: right bytes in the right pages, and nothing
//! outside them touched.
use clap::{Args, ValueEnum};
use pagewire_layout::{Component, Layout, Pool, PoolGeometry, PoolKind, TransferPlan};

use super::args::{EndArgs, Role, TransportArg};
use super::progress::{self, Progress, Unit};
use super::session::{self, EngineOpts, Local};

/// Model presets with their real KV geometry (per TP rank = the whole model here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
pub enum Preset {
    /// Llama-3-8B: MHA (GQA), 32 layers, 8 KV heads, head_dim 128.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Llama-3-70B: MHA (GQA), 80 layers, 8 KV heads, head_dim 128.
    #[value(name = "llama3-70b")]
    Llama3_70b,
    /// DeepSeek-V3: MLA, 61 layers, latent kv_lora_rank 512 + rope 64 = 576.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// MiMo-V2-like asymmetric MHA: head_dim 192, v_head_dim 128 (48 layers, 4 KV heads).
    #[value(name = "mimo-v2")]
    MimoV2,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Llama3_8b => "llama3-8b",
            Preset::Llama3_70b => "llama3-70b",
            Preset::DeepseekV3 => "deepseek-v3",
            Preset::MimoV2 => "mimo-v2",
        }
    }

    /// (kind, layers, heads, head_dim, v_head_dim or kv_dim)
    pub(crate) fn shape(self) -> (PoolKind, u64, u64, u64, u64) {
        match self {
            Preset::Llama3_8b => (PoolKind::Mha, 32, 8, 128, 128),
            Preset::Llama3_70b => (PoolKind::Mha, 80, 8, 128, 128),
            Preset::DeepseekV3 => (PoolKind::Mla, 61, 1, 576, 576),
            Preset::MimoV2 => (PoolKind::MhaSplit, 48, 4, 192, 128),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp8,
    Fp32,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8 => 1,
            Dtype::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Fp32 => "fp32",
        }
    }
}

/// Which pages of the pools a run moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Pages 0..N on both sides: the plan coalesces into a few large runs.
    Contiguous,
    /// N distinct pages drawn uniformly on each side: nothing coalesces.
    Random,
    /// Runs of 1..=8 consecutive pages separated by gaps of 1..=8: partial coalescing.
    Fragmented,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Contiguous => "contiguous",
            Pattern::Random => "random",
            Pattern::Fragmented => "fragmented",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PageOp {
    /// The client writes its pages into the server's pool.
    Write,
    /// The client reads the server's pages into its pool.
    Read,
}

fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse::<Layout>().map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Args)]
pub struct PagesArgs {
    #[command(flatten)]
    pub end: EndArgs,

    /// Model preset (KV geometry).
    #[arg(long, value_enum, default_value_t = Preset::Llama3_8b)]
    pub model: Preset,

    /// Element type of the pool.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,

    /// Override the preset's layer count (smaller pools for slow machines).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub layers: Option<u64>,

    /// Host-pool layout of both pools (SGLang names: layer_first, page_first,
    /// page_first_direct, page_head).
    #[arg(long, value_parser = parse_layout, default_value = "page_first")]
    pub layout: Layout,

    /// Layout of the source pool (overrides --layout).
    #[arg(long, value_parser = parse_layout)]
    pub src_layout: Option<Layout>,

    /// Layout of the destination pool (overrides --layout).
    #[arg(long, value_parser = parse_layout)]
    pub dst_layout: Option<Layout>,

    /// Tokens per page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub page_size: u64,

    /// Pages moved per batch.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub pages: u64,

    /// Pages in each pool. Default: 4 x --pages, but no more than fit in 64 MiB (and at
    /// least --pages), so that the default run fits a small machine.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub pool_pages: Option<u64>,

    /// Which pages move.
    #[arg(long, value_enum, default_value_t = Pattern::Random)]
    pub pattern: Pattern,

    /// Seed of the page draw and of the --verify pattern.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Direction: the client writes to, or reads from, the server's pool.
    #[arg(long, value_enum, default_value_t = PageOp::Write)]
    pub op: PageOp,

    /// Batches (each one moves --pages pages).
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub iters: u64,

    /// Batches in flight.
    #[arg(short = 't', long = "tx-depth", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub depth: u32,

    /// Queue pairs (verbs) or streams (TCP).
    #[arg(short = 'q', long = "qp", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub qps: u32,
}

/// The most bytes a default pool takes (`--pool-pages` not given).
pub const DEFAULT_POOL_CAP: u64 = 64 << 20;

impl PagesArgs {
    /// `--pool-pages`, else 4 x `--pages` capped at [`DEFAULT_POOL_CAP`] bytes (never
    /// below `--pages`). Both ends compute the same figure from the same flags.
    pub fn pool_pages(&self) -> u64 {
        self.pool_pages.unwrap_or_else(|| {
            let four = self.pages.saturating_mul(4);
            match self.page_bytes() {
                Some(b) if b > 0 => four.min(DEFAULT_POOL_CAP / b).max(self.pages),
                _ => four,
            }
        })
    }

    /// Whether the pool size is the capped default (said in the report).
    pub fn pool_capped(&self) -> bool {
        self.pool_pages.is_none() && self.pool_pages() < self.pages.saturating_mul(4)
    }

    /// Bytes of one page (all layers and buffers) of the geometry these flags describe.
    fn page_bytes(&self) -> Option<u64> {
        let (kind, layers, heads, d, dv) = self.model.shape();
        let layers = self.layers.unwrap_or(layers);
        let per_token = match kind {
            PoolKind::Mla => layers * d,
            _ => layers * heads * (d + dv),
        };
        per_token
            .checked_mul(self.dtype.bytes())?
            .checked_mul(self.page_size)
    }
    pub fn src_layout(&self) -> Layout {
        self.src_layout.unwrap_or(self.layout)
    }
    pub fn dst_layout(&self) -> Layout {
        self.dst_layout.unwrap_or(self.layout)
    }
}

/// The geometry both pools share.
pub fn geometry(a: &PagesArgs) -> anyhow::Result<PoolGeometry> {
    let (kind, layers, heads, d, dv) = a.model.shape();
    let layers = a.layers.unwrap_or(layers);
    let capacity = a.pool_pages().checked_mul(a.page_size).ok_or_else(|| {
        anyhow::anyhow!(
            "pool of {} pages x {} tokens overflows",
            a.pool_pages(),
            a.page_size
        )
    })?;
    let b = PoolGeometry::builder(kind)
        .layers(layers)
        .page_size(a.page_size)
        .dtype_bytes(a.dtype.bytes())
        .capacity(capacity);
    let b = match kind {
        PoolKind::Mla => b.kv_dim(d),
        PoolKind::MhaSplit => b.heads(heads).head_dim(d).v_head_dim(dv),
        _ => b.heads(heads).head_dim(d),
    };
    Ok(b.build()?)
}

/// Bytes of one pool, and the offset of its V buffer for `mha-split` (placed after K).
pub fn pool_bytes(g: &PoolGeometry) -> (u64, Option<u64>) {
    let k = g.buffer_bytes(Component::K);
    match g.kind() {
        PoolKind::Mla => (k, None),
        PoolKind::MhaSplit => (k + g.buffer_bytes(Component::V), Some(k)),
        // mha: one buffer holding K then V (SGLang's kv_buffer).
        _ => (k + g.buffer_bytes(Component::V), None),
    }
}

/// A pool placed at `base` (the start of its buffer).
pub fn place(g: PoolGeometry, layout: Layout, base: u64) -> anyhow::Result<Pool> {
    let (_, v_off) = pool_bytes(&g);
    Ok(Pool::new(g, layout, base, v_off.map(|o| base + o))?)
}

/// A small deterministic generator (splitmix64) so both ends draw the same pages.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0); the modulo bias is irrelevant at these sizes.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `n` distinct pages of a pool of `pool` pages, following `pattern`.
pub fn draw_pages(pattern: Pattern, n: u64, pool: u64, rng: &mut Rng) -> anyhow::Result<Vec<u64>> {
    anyhow::ensure!(n <= pool, "cannot pick {n} pages from a pool of {pool}");
    Ok(match pattern {
        Pattern::Contiguous => (0..n).collect(),
        Pattern::Random => {
            // Partial Fisher-Yates over the page ids.
            let mut ids: Vec<u64> = (0..pool).collect();
            for i in 0..n as usize {
                let j = i + rng.below(pool - i as u64) as usize;
                ids.swap(i, j);
            }
            ids.truncate(n as usize);
            ids
        }
        Pattern::Fragmented => {
            let mut out = Vec::with_capacity(n as usize);
            let mut p = rng.below(8);
            while (out.len() as u64) < n {
                let run = 1 + rng.below(8);
                for _ in 0..run {
                    if (out.len() as u64) == n {
                        break;
                    }
                    if p >= pool {
                        // Wrapped: fall back to the lowest unused pages, in order.
                        break;
                    }
                    out.push(p);
                    p += 1;
                }
                p += 1 + rng.below(8);
                if p >= pool && (out.len() as u64) < n {
                    let used: std::collections::HashSet<u64> = out.iter().copied().collect();
                    out.extend(
                        (0..pool)
                            .filter(|q| !used.contains(q))
                            .take(n as usize - out.len()),
                    );
                }
            }
            out
        }
    })
}

/// The page mapping of a run: `src[i]` moves to `dst[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub src: Vec<u64>,
    pub dst: Vec<u64>,
}

pub fn mapping(a: &PagesArgs) -> anyhow::Result<Mapping> {
    let mut rng = Rng::new(a.seed);
    let pool = a.pool_pages();
    let src = draw_pages(a.pattern, a.pages, pool, &mut rng)?;
    let dst = draw_pages(a.pattern, a.pages, pool, &mut rng)?;
    Ok(Mapping { src, dst })
}

/// Figures about a plan for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PlanStats {
    /// Per-page segments of the source (SGLang's `get_page_buffer_meta` entries).
    pub segments_raw: u64,
    /// Transfers in the coalesced plan.
    pub segments_plan: u64,
    /// Work requests after slicing at the engine's largest WR.
    pub work_requests: u64,
    pub bytes: u64,
}

pub fn plan_stats(src: &Pool, plan: &TransferPlan, pages: u64, max_wr: u64) -> PlanStats {
    let max_wr = max_wr.max(1);
    PlanStats {
        segments_raw: pages * src.entries_per_page() as u64,
        segments_plan: plan.len() as u64,
        work_requests: plan.lens().iter().map(|l| l.div_ceil(max_wr)).sum(),
        bytes: plan.total_bytes(),
    }
}

/// Replays `plan` with memcpy: `src_mem` starts at address `src_base`, `dst_mem` at
/// `dst_base`: the reference `verify_pool` is tested against.
#[cfg(test)]
pub fn replay(
    plan: &TransferPlan,
    src_mem: &[u8],
    src_base: u64,
    dst_mem: &mut [u8],
    dst_base: u64,
) -> anyhow::Result<()> {
    for t in plan.iter() {
        let s = t
            .src
            .checked_sub(src_base)
            .ok_or_else(|| anyhow::anyhow!("plan source {:#x} below its pool", t.src))?
            as usize;
        let d = t
            .dst
            .checked_sub(dst_base)
            .ok_or_else(|| anyhow::anyhow!("plan destination {:#x} below its pool", t.dst))?
            as usize;
        let n = t.len as usize;
        anyhow::ensure!(
            s + n <= src_mem.len() && d + n <= dst_mem.len(),
            "plan transfer {t:?} outside the pools"
        );
        dst_mem[d..d + n].copy_from_slice(&src_mem[s..s + n]);
    }
    Ok(())
}

/// Everything the report shows about one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PagesReport {
    pub op: PageOp,
    pub model: &'static str,
    pub kind: String,
    pub layers: u64,
    pub heads: u64,
    pub head_dim: u64,
    pub v_head_dim: u64,
    pub dtype: &'static str,
    pub page_size: u64,
    pub page_bytes: u64,
    pub src_layout: String,
    pub dst_layout: String,
    pub pool_pages: u64,
    pub pool_bytes: u64,
    /// The default pool was capped (see `--pool-pages`).
    pub pool_capped: bool,
    pub pattern: Pattern,
    pub seed: u64,
    pub transport: String,
    pub device: String,
    pub lanes: u16,
    pub depth: u32,
    pub pages: u64,
    pub batches: u64,
    #[serde(flatten)]
    pub plan: PlanStats,
    pub max_wr_bytes: u64,
    pub plan_build_us: f64,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub mib_per_s: f64,
    pub pages_per_s: f64,
    pub batch_p50_us: f64,
    pub batch_p99_us: f64,
    pub batch_p999_us: f64,
    /// None when --verify was not given.
    pub verified: Option<bool>,
    pub verify_detail: String,
}

impl PagesReport {
    pub fn render(&self) -> String {
        use super::report::RESULT_LINE;
        use std::fmt::Write as _;
        let mut s = String::new();
        let verb = match self.op {
            PageOp::Write => "RDMA_Write",
            PageOp::Read => "RDMA_Read",
        };
        let _ = writeln!(s, "{RESULT_LINE}");
        let _ = writeln!(s, "                    KV Page Transfer ({verb})");
        let dims = if self.kind == "mla" {
            format!("L={} C={}", self.layers, self.head_dim)
        } else {
            format!(
                "L={} H={} D={} Dv={}",
                self.layers, self.heads, self.head_dim, self.v_head_dim
            )
        };
        let _ = writeln!(
            s,
            " Model           : {} ({}, {dims}, {})",
            self.model, self.kind, self.dtype
        );
        let _ = writeln!(
            s,
            " Page            : {} tokens, {} B (all layers and buffers)",
            self.page_size, self.page_bytes
        );
        let _ = writeln!(
            s,
            " Layouts         : {} -> {}",
            self.src_layout, self.dst_layout
        );
        let _ = writeln!(
            s,
            " Pool            : {} pages, {} B per side{}",
            self.pool_pages,
            self.pool_bytes,
            if self.pool_capped {
                format!(" (default capped at {} MiB)", DEFAULT_POOL_CAP >> 20)
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            s,
            " Pattern         : {}, seed {}",
            self.pattern.name(),
            self.seed
        );
        let _ = writeln!(
            s,
            " Device          : {}\t\tTransport type : {}",
            self.device, self.transport
        );
        let _ = writeln!(
            s,
            " Lanes           : {}\t\tBatches in flight : {}",
            self.lanes, self.depth
        );
        let _ = writeln!(s, "{RESULT_LINE}");
        let avg_wr = self
            .plan
            .bytes
            .checked_div(self.plan.work_requests)
            .unwrap_or(0);
        let rows: [(&str, String); 12] = [
            ("pages per batch", self.pages.to_string()),
            ("bytes per batch", self.plan.bytes.to_string()),
            (
                "segments before coalescing",
                self.plan.segments_raw.to_string(),
            ),
            (
                "segments after coalescing",
                self.plan.segments_plan.to_string(),
            ),
            (
                "work requests per batch",
                format!(
                    "{} (at most {} B each, {} B on average)",
                    self.plan.work_requests, self.max_wr_bytes, avg_wr
                ),
            ),
            ("plan build [usec]", format!("{:.2}", self.plan_build_us)),
            ("batches", self.batches.to_string()),
            ("elapsed [sec]", format!("{:.3}", self.seconds)),
            (
                "bandwidth",
                format!("{:.3} GB/s ({:.2} MiB/sec)", self.gb_per_s, self.mib_per_s),
            ),
            ("pages per second", format!("{:.1}", self.pages_per_s)),
            (
                "batch latency [usec]",
                format!(
                    "p50 {:.2}  p99 {:.2}  p99.9 {:.2}",
                    self.batch_p50_us, self.batch_p99_us, self.batch_p999_us
                ),
            ),
            (
                "verify",
                match self.verified {
                    None => "not requested (--verify)".into(),
                    Some(true) => format!("OK: {}", self.verify_detail),
                    Some(false) => format!("FAILED: {}", self.verify_detail),
                },
            ),
        ];
        for (k, v) in rows {
            let _ = writeln!(s, " {k:<27}: {v}");
        }
        let _ = writeln!(s, "{RESULT_LINE}");
        s
    }
}

/// The flags both ends must agree on, and this end's resolved transport.
fn sym_params(a: &PagesArgs, transport: &str) -> serde_json::Value {
    serde_json::json!({
        "model": a.model,
        "dtype": a.dtype,
        "layers": a.layers,
        "src_layout": a.src_layout().as_str(),
        "dst_layout": a.dst_layout().as_str(),
        "page_size": a.page_size,
        "pages": a.pages,
        "pool_pages": a.pool_pages(),
        "pattern": a.pattern,
        "seed": a.seed,
        "op": a.op,
        "iters": a.iters,
        "depth": a.depth,
        "qps": a.qps,
        "verify": a.end.verify,
        "transport": transport,
    })
}

fn engine_opts(a: &PagesArgs, transport: TransportArg) -> EngineOpts {
    EngineOpts {
        transport,
        lanes: a.qps,
        device: a.end.device.clone(),
        gid_index: a.end.gid_index,
        ib_port: a.end.ib_port,
        tx_depth: 0,
        progress: None,
    }
}

/// The pool content the source side starts with; the receiver regenerates it.
fn source_seed(a: &PagesArgs) -> u64 {
    super::pattern::seed_for("pages", a.seed, 0)
}

/// Receiver's check, over its whole pool and without a copy of it: every transfer of the
/// plan must have put the source pattern (regenerated from the seed at the transfer's
/// source offset) at its destination, and every byte outside those ranges must still be
/// the zero it started as. `Ok(Err(..))` names the first wrong byte.
fn verify_pool(
    a: &PagesArgs,
    g: PoolGeometry,
    received: &[u8],
) -> anyhow::Result<Result<String, String>> {
    let (bytes, _) = pool_bytes(&g);
    anyhow::ensure!(
        received.len() as u64 >= bytes,
        "pool of {} B, expected {bytes}",
        received.len()
    );
    let src = place(g, a.src_layout(), 0)?;
    let dst = place(g, a.dst_layout(), 0)?;
    let m = mapping(a)?;
    let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst)?;
    let seed = source_seed(a);
    let mut runs: Vec<(u64, u64, u64)> = plan.iter().map(|t| (t.dst, t.src, t.len)).collect();
    runs.sort_unstable();
    let zero_from = |from: u64, to: u64| {
        received[from as usize..to as usize]
            .iter()
            .position(|&b| b != 0)
            .map(|i| {
                let at = from as usize + i;
                format!(
                    "pool byte {at} is {:#04x}, expected 0x00 (outside the moved pages)",
                    received[at]
                )
            })
    };
    let mut want = vec![0u8; 1 << 16];
    let mut pos = 0u64;
    let mut moved = 0u64;
    for (d, src_off, len) in runs {
        anyhow::ensure!(
            d >= pos && d + len <= bytes,
            "plan destination {d}+{len} overlaps another or leaves the pool"
        );
        if let Some(e) = zero_from(pos, d) {
            return Ok(Err(e));
        }
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(want.len() as u64);
            let w = &mut want[..n as usize];
            super::pattern::fill_at_byte(w, seed, src_off + off);
            let at = (d + off) as usize;
            let got = &received[at..at + n as usize];
            if let Some(i) = got.iter().zip(w.iter()).position(|(x, y)| x != y) {
                return Ok(Err(format!(
                    "pool byte {} is {:#04x}, expected {:#04x}",
                    at + i,
                    got[i],
                    w[i]
                )));
            }
            off += n;
        }
        moved += len;
        pos = d + len;
    }
    if let Some(e) = zero_from(pos, bytes) {
        return Ok(Err(e));
    }
    Ok(Ok(format!(
        "the receiver checked all {bytes} B of its pool: {moved} B moved as the plan says, \
         the rest untouched"
    )))
}

pub fn run(args: PagesArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    geometry(&args)?;
    mapping(&args)?;
    let transport = args.end.transport(false)?;
    match args.end.role() {
        Role::Client(addr) => {
            let server = session::server_target(&addr, args.end.port)?;
            check_pool_memory(&args, 1)?;
            let end = PagesEnd::open(&args, transport, false)?;
            end.run_client(&args, server).map(|_| ())
        }
        Role::Server => {
            let listener = std::net::TcpListener::bind(("0.0.0.0", args.end.port))
                .with_context(|| format!("binding the side channel on port {}", args.end.port))?;
            check_pool_memory(&args, 1)?;
            let end = PagesEnd::open(&args, transport, false)?;
            end.serve(&args, listener, false)
        }
        Role::Local => in_process(&args, transport).map(|_| ()),
    }
}

/// Refuses pools that would not fit in this machine's available memory (`ends` pools
/// in this process), before allocating them.
fn check_pool_memory(a: &PagesArgs, ends: u64) -> anyhow::Result<()> {
    let (bytes, _) = pool_bytes(&geometry(a)?);
    session::check_memory(
        bytes.saturating_mul(ends),
        &format!(
            "a pool of {} pages ({} MiB per end)",
            a.pool_pages(),
            bytes >> 20
        ),
        "use fewer --pages or --pool-pages, or --layers to shrink the model",
    )
}

fn in_process(args: &PagesArgs, transport: TransportArg) -> anyhow::Result<PagesReport> {
    check_pool_memory(args, 2)?;
    let server_end = PagesEnd::open(args, transport, true)?;
    let client_end = PagesEnd::open(args, transport, true)?;
    let a2 = args.clone();
    let (addr, t) = session::spawn_local_server(move |l| server_end.serve(&a2, l, true))?;
    let r = client_end.run_client(args, addr);
    if r.is_err() {
        session::wake_local_server(addr);
    }
    let report = match &r {
        Ok(rep) => Some(rep.clone()),
        Err(_) => None,
    };
    session::join_local(t, r.map(|_| ()))?;
    Ok(report.expect("client succeeded"))
}

/// The README's main job, part 1: a verified KV page transfer between two engines in
/// this process over the best transport (a Llama-3-8B pool, random pages; two 64 MiB
/// pools, so that it fits a small machine; 10 batches of 32 MiB, about 15 s on
/// soft-RoCE under emulation).
pub fn run_default() -> anyhow::Result<()> {
    use clap::Parser;
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: PagesArgs,
    }
    let args = Wrap::try_parse_from([
        "pages",
        "--local",
        "--model",
        "llama3-8b",
        "--pattern",
        "random",
        "--pages",
        "16",
        "--page-size",
        "16",
        "-n",
        "10",
        "--verify",
    ])
    .expect("fixed argv parses")
    .a;
    eprintln!(
        " pagewire: end-to-end KV page transfer between two engines in this process (best available transport)"
    );
    let transport = args.end.transport(false)?;
    in_process(&args, transport).map(|_| ())
}

/// One end before it meets the other: its engine open, its pool allocated and
/// registered, so that a transport that cannot be used fails at once with its reason.
struct PagesEnd {
    engine: pagewire_transport::Engine,
    local: Local,
    g: PoolGeometry,
}

impl PagesEnd {
    fn open(a: &PagesArgs, transport: TransportArg, in_process: bool) -> anyhow::Result<PagesEnd> {
        let listen: std::net::SocketAddr = if in_process {
            "127.0.0.1:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .expect("literal");
        let engine = session::open_engine(&engine_opts(a, transport), listen)?;
        let g = geometry(a)?;
        let (bytes, _) = pool_bytes(&g);
        let local = Local::new(&engine, bytes)?;
        Ok(PagesEnd { engine, local, g })
    }

    /// The source pool holds the seeded pattern, the destination zeros; writing it also
    /// faults every page in before the clock starts.
    fn fill(&mut self, a: &PagesArgs, source: bool) {
        if source {
            let len = self.local.buf.len();
            super::pattern::fill_buf(&mut self.local.buf, 0, len, source_seed(a));
        } else {
            self.local.buf.fill(0);
        }
    }

    /// Waits for one client, serves its run, returns. A client that fails between its
    /// hello and the first barrier is dropped; the server keeps waiting for another.
    fn serve(
        mut self,
        a: &PagesArgs,
        listener: std::net::TcpListener,
        quiet: bool,
    ) -> anyhow::Result<()> {
        use super::oob::{Msg, Welcome};
        let timeout = std::time::Duration::from_secs_f64(a.end.timeout);
        let transport = self.engine.backend_kind().to_string();
        let params = sym_params(a, &transport);
        let bytes = self.local.buf.len() as u64;
        if !quiet {
            eprintln!(
                " pagewire bench pages: server over {}, pool {} MiB, waiting for one client \
                 (side channel port {})",
                session::describe(&self.engine),
                bytes >> 20,
                listener.local_addr()?.port()
            );
        }
        let mut ch = loop {
            let mut ch = session::server_accept(&listener, "pages", &params, timeout, quiet)?;
            while self.engine.accept(std::time::Instant::now()).is_some() {}
            self.fill(a, a.op == PageOp::Read);
            let setup = (|| {
                ch.send(&Msg::Welcome(Welcome {
                    engine_port: self.engine.local_addr().port(),
                    buf_len: bytes,
                }))?;
                session::accept_engine(&self.engine, timeout)?;
                ch.barrier(1)?;
                anyhow::Ok(())
            })();
            match setup {
                Ok(()) => break ch,
                Err(e) if !quiet => {
                    eprintln!(" pagewire: client setup failed: {e:#}; waiting for another client");
                }
                Err(e) => return Err(e),
            }
        };
        // `timeout` bounds each of the client's batch waits, not its whole run: a slow run
        // (many ops, a loaded machine) may last up to `iters` of them. Waiting only
        // `timeout` here dropped the engine mid-run and the client saw "peer gone". A
        // client that dies still shows up at once as EOF.
        let run = u32::try_from(a.iters.saturating_add(1)).unwrap_or(u32::MAX);
        ch.set_timeout(timeout.saturating_mul(run))?;
        ch.barrier(2)?;
        ch.set_timeout(timeout)?;
        let mut outcome = Ok(());
        if a.end.verify && a.op == PageOp::Write {
            // SAFETY: barrier 2 means the client's last batch completed, and no other peer
            // is connected to this bench engine: nothing writes the pool while it is read.
            let v = verify_pool(a, self.g, unsafe { self.local.buf.as_slice() })?;
            let (ok, detail) = match &v {
                Ok(d) => (true, d.clone()),
                Err(d) => (false, d.clone()),
            };
            ch.send(&Msg::Verified {
                size: bytes,
                ok,
                detail: detail.clone(),
            })?;
            if !ok {
                outcome = Err(anyhow::anyhow!(
                    "verification failed on the server: {detail}"
                ));
            }
        }
        ch.barrier(3)?;
        if !quiet {
            eprintln!(
                " pagewire bench pages: run finished ({} batches of {} pages)",
                a.iters, a.pages
            );
        }
        self.engine.shutdown();
        outcome
    }

    fn run_client(
        mut self,
        a: &PagesArgs,
        server: std::net::SocketAddr,
    ) -> anyhow::Result<PagesReport> {
        use anyhow::{Context, anyhow, ensure};
        use pagewire_transport::Op;
        use std::time::{Duration, Instant};
        let timeout = Duration::from_secs_f64(a.end.timeout);
        let params = sym_params(a, &self.engine.backend_kind().to_string());
        let (mut ch, w) = session::client_hello(server, "pages", params, timeout)?;
        let g = self.g;
        let (bytes, _) = pool_bytes(&g);
        ensure!(
            w.buf_len == bytes,
            "the server's pool is {} B, this run's is {bytes} B",
            w.buf_len
        );
        self.fill(a, a.op == PageOp::Write);
        let PagesEnd { engine, local, .. } = self;
        let peer = session::connect_engine(&engine, server, &w)?;
        let remote = session::remote_buffer(&engine, peer, bytes)?;
        let (src_base, dst_base, op) = match a.op {
            PageOp::Write => (local.base(), remote.addr, Op::Write),
            PageOp::Read => (remote.addr, local.base(), Op::Read),
        };
        let m = mapping(a)?;
        let t0 = Instant::now();
        let src = place(g, a.src_layout(), src_base)?;
        let dst = place(g, a.dst_layout(), dst_base)?;
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst)
            .context("building the transfer plan")?;
        let plan_build_us = t0.elapsed().as_secs_f64() * 1e6;
        let info = engine.backend_info();
        let pstats = plan_stats(&src, &plan, a.pages, info.max_wr_bytes);
        let triples: Vec<(u64, u64, u64)> = plan.iter().map(|t| (t.src, t.dst, t.len)).collect();

        let mut bar = Progress::new(
            a.iters,
            Unit::Count("batches"),
            progress::wanted(a.end.json, true),
            1,
        );
        ch.barrier(1)?;
        let start = Instant::now();
        let mut inflight = std::collections::VecDeque::new();
        let mut lat_us = Vec::with_capacity(a.iters as usize);
        let mut submitted = 0u64;
        let mut last_done = start;
        while submitted < a.iters || !inflight.is_empty() {
            while submitted < a.iters && inflight.len() < a.depth as usize {
                let t = Instant::now();
                let h = engine
                    .submit_plan(peer, op, triples.iter().copied(), None)
                    .context("submitting a page batch")?;
                inflight.push_back((h, t));
                submitted += 1;
            }
            let (h, t) = inflight.pop_front().expect("in flight");
            h.wait(Instant::now() + timeout)
                .with_context(|| format!("page batch {}", lat_us.len()))?;
            last_done = Instant::now();
            lat_us.push(last_done.duration_since(t).as_secs_f64() * 1e6);
            bar.add(1);
        }
        bar.finish();
        ch.barrier(2)?;
        let secs = last_done.duration_since(start).as_secs_f64().max(1e-9);
        let verified = if !a.end.verify {
            None
        } else if a.op == PageOp::Read {
            // SAFETY: every READ batch of this run has been waited for, and the only peer,
            // the bench server, posts no transfers (the client drives every op): nothing
            // writes the pool while it is read.
            let pool = unsafe { local.buf.as_slice() };
            Some(verify_pool(a, g, pool)?.map_err(|e| format!("client: {e}")))
        } else {
            let (ok, detail) = ch.recv_verified()?;
            Some(if ok {
                Ok(detail)
            } else {
                Err(format!("server: {detail}"))
            })
        };
        ch.barrier(3)?;
        engine.shutdown();
        lat_us.sort_by(f64::total_cmp);
        let total = pstats.bytes as f64 * a.iters as f64;
        let report = PagesReport {
            op: a.op,
            model: a.model.name(),
            kind: g.kind().to_string(),
            layers: g.layers(),
            heads: g.heads(),
            head_dim: g.head_dim(),
            v_head_dim: g.v_head_dim(),
            dtype: a.dtype.name(),
            page_size: a.page_size,
            page_bytes: g.bytes_per_token() * a.page_size,
            src_layout: a.src_layout().to_string(),
            dst_layout: a.dst_layout().to_string(),
            pool_pages: a.pool_pages(),
            pool_bytes: bytes,
            pool_capped: a.pool_capped(),
            pattern: a.pattern,
            seed: a.seed,
            transport: info.kind.to_string(),
            device: info.device.clone(),
            lanes: info.lanes_per_peer,
            depth: a.depth,
            pages: a.pages,
            batches: a.iters,
            plan: pstats,
            max_wr_bytes: info.max_wr_bytes,
            plan_build_us,
            seconds: secs,
            gb_per_s: total / secs / 1e9,
            mib_per_s: total / secs / super::stats::MIB,
            pages_per_s: (a.pages * a.iters) as f64 / secs,
            batch_p50_us: super::stats::percentile(&lat_us, 50.0),
            batch_p99_us: super::stats::percentile(&lat_us, 99.0),
            batch_p999_us: super::stats::percentile(&lat_us, 99.9),
            verified: verified.as_ref().map(|v| v.is_ok()),
            verify_detail: match &verified {
                Some(Ok(d)) | Some(Err(d)) => d.clone(),
                None => String::new(),
            },
        };
        if a.end.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", report.render());
        }
        if let Some(Err(e)) = verified {
            return Err(anyhow!("verification failed on the {e}"));
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        a: PagesArgs,
    }

    fn parse(argv: &[&str]) -> PagesArgs {
        Cli::try_parse_from(std::iter::once("pages").chain(argv.iter().copied()))
            .unwrap()
            .a
    }

    #[test]
    fn presets_have_their_real_geometry() {
        let g = geometry(&parse(&["--page-size", "64", "--pool-pages", "2"])).unwrap();
        // Llama-3-8B: 2 * 32 layers * 8 heads * 128 * 2 B = 128 KiB per token.
        assert_eq!(g.bytes_per_token(), 131072);
        assert_eq!(g.page_bytes(Component::K), 32 * 64 * 8 * 128 * 2);
        let g = geometry(&parse(&["--model", "deepseek-v3", "--pool-pages", "2"])).unwrap();
        assert_eq!(g.kind(), PoolKind::Mla);
        assert_eq!(g.bytes_per_token(), 61 * 576 * 2);
        let g = geometry(&parse(&[
            "--model",
            "deepseek-v3",
            "--dtype",
            "fp8",
            "--pool-pages",
            "2",
        ]))
        .unwrap();
        assert_eq!(g.bytes_per_token(), 61 * 576);
        let g = geometry(&parse(&["--model", "mimo-v2", "--pool-pages", "2"])).unwrap();
        assert_eq!(g.kind(), PoolKind::MhaSplit);
        assert_eq!(g.bytes_per_token(), 48 * 4 * (192 + 128) * 2);
        let (bytes, v) = pool_bytes(&g);
        assert_eq!(v, Some(g.buffer_bytes(Component::K)));
        assert_eq!(
            bytes,
            g.buffer_bytes(Component::K) + g.buffer_bytes(Component::V)
        );
    }

    #[test]
    fn draws_are_distinct_in_range_and_deterministic() {
        for pattern in [Pattern::Contiguous, Pattern::Random, Pattern::Fragmented] {
            for (n, pool) in [(1, 1), (5, 5), (32, 128), (100, 101), (64, 64)] {
                let a = draw_pages(pattern, n, pool, &mut Rng::new(7)).unwrap();
                let b = draw_pages(pattern, n, pool, &mut Rng::new(7)).unwrap();
                assert_eq!(a, b);
                assert_eq!(a.len() as u64, n, "{pattern:?} {n}/{pool}");
                let set: std::collections::HashSet<_> = a.iter().collect();
                assert_eq!(set.len() as u64, n, "{pattern:?} duplicates");
                assert!(a.iter().all(|&p| p < pool));
            }
        }
        assert!(draw_pages(Pattern::Random, 3, 2, &mut Rng::new(1)).is_err());
    }

    #[test]
    fn contiguous_coalesces_and_random_does_not() {
        let a = parse(&[
            "--pages",
            "16",
            "--pool-pages",
            "64",
            "--layers",
            "2",
            "--pattern",
            "contiguous",
        ]);
        let g = geometry(&a).unwrap();
        let (bytes, _) = pool_bytes(&g);
        let src = place(g, a.src_layout(), 0x10_0000).unwrap();
        let dst = place(g, a.dst_layout(), 0x10_0000 + bytes).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        let st = plan_stats(&src, &plan, 16, 1 << 20);
        assert_eq!(st.segments_raw, 32);
        assert_eq!(st.segments_plan, 2, "K run and V run");
        assert_eq!(st.bytes, 16 * g.page_bytes(Component::K) * 2);
        let a = parse(&[
            "--pages",
            "16",
            "--pool-pages",
            "4096",
            "--layers",
            "2",
            "--pattern",
            "random",
        ]);
        let g = geometry(&a).unwrap();
        let src = place(g, a.src_layout(), 0).unwrap();
        let dst = place(g, a.dst_layout(), 1 << 40).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        assert!(plan_stats(&src, &plan, 16, 1 << 20).segments_plan >= 30);
    }

    #[test]
    fn replay_moves_pages_across_layouts() {
        let a = parse(&[
            "--pages",
            "3",
            "--pool-pages",
            "6",
            "--layers",
            "2",
            "--page-size",
            "2",
            "--src-layout",
            "layer_first",
            "--dst-layout",
            "page_head",
            "--model",
            "mimo-v2",
        ]);
        let g = geometry(&a).unwrap();
        let (bytes, _) = pool_bytes(&g);
        let src = place(g, a.src_layout(), 0).unwrap();
        // SGLang refuses page_head for head_dim != v_head_dim; the layout crate extends it.
        let dst = place(g, a.dst_layout(), 0).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        let mut s = vec![0u8; bytes as usize];
        super::super::pattern::fill(&mut s, 9);
        let mut d = vec![0u8; bytes as usize];
        replay(&plan, &s, 0, &mut d, 0).unwrap();
        // Element (K, token 0 of the page, layer 1, head 3, dim 5) moved with its page.
        let (sp, dp) = (m.src[1], m.dst[1]);
        let se = src.element_addr(Component::K, sp * 2, 1, 3, 5).unwrap() as usize;
        let de = dst.element_addr(Component::K, dp * 2, 1, 3, 5).unwrap() as usize;
        assert_eq!(s[se..se + 2], d[de..de + 2]);
    }

    /// The receiver's check agrees with a replay of the plan into a zeroed pool: it
    /// accepts exactly that pool, and names the first byte of any other.
    #[test]
    fn verify_pool_accepts_the_replay_and_names_a_wrong_byte() {
        for (model, src_l, dst_l, pattern) in [
            ("llama3-8b", "page_first", "layer_first", "random"),
            ("mimo-v2", "layer_first", "page_head", "fragmented"),
            (
                "deepseek-v3",
                "page_first_direct",
                "page_first",
                "contiguous",
            ),
        ] {
            let a = parse(&[
                "--model",
                model,
                "--layers",
                "2",
                "--page-size",
                "2",
                "--pages",
                "5",
                "--pool-pages",
                "12",
                "--src-layout",
                src_l,
                "--dst-layout",
                dst_l,
                "--pattern",
                pattern,
            ]);
            let g = geometry(&a).unwrap();
            let (bytes, _) = pool_bytes(&g);
            let src = place(g, a.src_layout(), 0).unwrap();
            let dst = place(g, a.dst_layout(), 0).unwrap();
            let m = mapping(&a).unwrap();
            let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
            let mut s = vec![0u8; bytes as usize];
            super::super::pattern::fill(&mut s, source_seed(&a));
            let mut d = vec![0u8; bytes as usize];
            replay(&plan, &s, 0, &mut d, 0).unwrap();
            assert!(verify_pool(&a, g, &d).unwrap().is_ok(), "{model}");
            // A moved byte, and a byte outside the moved pages, each caught by offset.
            let moved = plan.iter().next().unwrap().dst as usize + 3;
            let outside = (0..d.len())
                .rev()
                .find(|&i| d[i] == 0 && s[i] != 0)
                .unwrap();
            for at in [moved, outside] {
                let mut bad = d.clone();
                bad[at] ^= 0x5a;
                let e = verify_pool(&a, g, &bad).unwrap().unwrap_err();
                assert!(e.starts_with(&format!("pool byte {at} ")), "{model}: {e}");
            }
        }
    }

    #[test]
    fn default_pool_is_capped_and_both_ends_agree() {
        // Llama-3-8B, 16-token pages: 2 MiB a page; 4 x 16 pages would be 128 MiB.
        let a = parse(&[]);
        assert_eq!(a.pages, 16);
        assert_eq!(a.pool_pages(), 32);
        assert!(a.pool_capped());
        let (bytes, _) = pool_bytes(&geometry(&a).unwrap());
        assert_eq!(bytes, DEFAULT_POOL_CAP);
        // Never below --pages; an explicit --pool-pages is taken as given.
        let a = parse(&["--model", "llama3-70b", "--pages", "16"]);
        assert_eq!(a.pool_pages(), 16);
        let a = parse(&["--pool-pages", "100"]);
        assert_eq!(a.pool_pages(), 100);
        assert!(!a.pool_capped());
        // Small pages: the plain 4 x --pages.
        let a = parse(&["--layers", "1", "--page-size", "1"]);
        assert_eq!(a.pool_pages(), 64);
        assert!(!a.pool_capped());
    }
}
