//! The report of a run: a perftest-like text block, or one JSON record.
use pagewire_layout::PoolGeometry;

use super::presets::pool_bytes;
use super::workload::{PageOp, Pattern, PlanStats};
use super::{DEFAULT_POOL_CAP, PagesArgs};
use crate::bench::stats;

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

/// What the client's run measured (the rest of the report comes from the flags and
/// the engine).
#[derive(Debug)]
pub struct Measured<'a> {
    pub plan: PlanStats,
    pub plan_build_us: f64,
    pub seconds: f64,
    /// Each batch's time from submit to completion, in microseconds (any order).
    pub batch_us: Vec<f64>,
    /// `None` without --verify, else the verdict: which side checked, and what it found.
    pub verified: &'a Option<Result<String, String>>,
}

impl PagesReport {
    pub fn new(
        a: &PagesArgs,
        g: &PoolGeometry,
        info: &pagewire_transport::BackendInfo,
        m: Measured<'_>,
    ) -> Self {
        let Measured {
            plan,
            plan_build_us,
            seconds: secs,
            batch_us: mut lat_us,
            verified,
        } = m;
        lat_us.sort_by(f64::total_cmp);
        let total = plan.bytes as f64 * a.iters as f64;
        PagesReport {
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
            pool_bytes: pool_bytes(g).0,
            pool_capped: a.pool_capped(),
            pattern: a.pattern,
            seed: a.seed,
            transport: info.kind.to_string(),
            device: info.device.clone(),
            lanes: info.qps_or_streams,
            depth: a.depth,
            pages: a.pages,
            batches: a.iters,
            plan,
            max_wr_bytes: info.max_wr_bytes,
            plan_build_us,
            seconds: secs,
            gb_per_s: total / secs / 1e9,
            mib_per_s: total / secs / stats::MIB,
            pages_per_s: (a.pages * a.iters) as f64 / secs,
            batch_p50_us: stats::percentile(&lat_us, 50.0),
            batch_p99_us: stats::percentile(&lat_us, 99.0),
            batch_p999_us: stats::percentile(&lat_us, 99.9),
            verified: verified.as_ref().map(|v| v.is_ok()),
            verify_detail: match verified {
                Some(Ok(d)) | Some(Err(d)) => d.clone(),
                None => String::new(),
            },
        }
    }

    /// On stdout: one JSON record with --json, else the text block.
    pub fn print(&self, json: bool) -> anyhow::Result<()> {
        if json {
            println!("{}", serde_json::to_string(self)?);
        } else {
            print!("{}", self.render());
        }
        Ok(())
    }

    pub fn render(&self) -> String {
        use crate::bench::report::RESULT_LINE;
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
