//! `pagewire layout ...`: parity interface for SGLang's page metadata and the PD plan.
//!
//! External tooling compares these outputs with SGLang, so the flag names and the JSON
//! shapes (`{"ptrs":[...],"lens":[...]}` and `{"srcs":[...],"dsts":[...],"lens":[...]}`)
//! are a contract. Values are taken as strings and parsed here, so that every bad value
//! ends as one `pagewire: error: ...` line naming the flag.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use pagewire_layout::{
    Checks, Component, HeadShards, Layout, PdBuffers, Pool, PoolGeometry, PoolKind, Segment,
    Segments, TransferPlan, pd_connector_plan, plan_with_heads,
};
use serde::Serialize;

const LAYOUT_EXAMPLES: &str = "\
Examples:
  pagewire layout meta --model llama3-8b --layout page_first --capacity 64 --base 0x1000 --indices 0..32
  pagewire layout pd-plan --src-k 0x1000 --dst-k 0x9000 --k-item-len 256 --src-pages 0,1 --dst-pages 4,5
  pagewire layout plan --model deepseek-v3 --src-layout layer_first --dst-layout page_first \\
      --src-capacity 64 --dst-capacity 64 --src-base 0 --dst-base 0x10000000 --src-pages 0..4 --dst-pages 4..8";

const META_EXAMPLES: &str = "\
Examples:
  # a model preset gives the geometry (page size 16, bf16 unless told otherwise)
  pagewire layout meta --model llama3-8b --layout page_first --capacity 64 --base 0x1000 --indices 0..32
  # every geometry flag by hand (what SGLang's get_page_buffer_meta is called with)
  pagewire layout meta --pool mha --layers 2 --page-size 4 --heads 2 --head-dim 3 --dtype-bytes 2 \\
      --layout page_first --capacity 32 --base 0x1000 --indices 8..16 --json
  pagewire layout meta --model deepseek-v3 --layout layer_first --capacity 64 --base 0 --indices 0..16 --coalesce";

const PD_PLAN_EXAMPLES: &str = "\
Examples:
  pagewire layout pd-plan --src-k 0x1000,0x2000 --dst-k 0x9000,0xa000 --k-item-len 256 \\
      --src-pages 0,1,5 --dst-pages 3,4,9 --json
  pagewire layout pd-plan --src-k 0x1000 --dst-k 0x9000 --src-v 0x5000 --dst-v 0xd000 \\
      --k-item-len 256 --v-item-len 128 --src-pages 0..4 --dst-pages 4..8";

const PLAN_EXAMPLES: &str = "\
Examples:
  pagewire layout plan --model llama3-8b --src-layout layer_first --dst-layout page_first \\
      --src-capacity 64 --dst-capacity 64 --src-base 0x100000 --dst-base 0x10000000 \\
      --src-pages 0,1,2 --dst-pages 7,8,9
  # TP 2 -> TP 1: the source rank holds heads 4..8 of the destination's 8
  pagewire layout plan --model llama3-8b --src-heads 4 --dst-heads 8 --src-tp-rank 1 \\
      --src-layout page_head --dst-layout page_head --src-capacity 64 --dst-capacity 64 \\
      --src-base 0 --dst-base 0x10000000 --src-pages 0..2 --dst-pages 2..4 --json";

#[derive(Debug, Subcommand)]
#[command(after_help = LAYOUT_EXAMPLES)]
pub enum LayoutCommand {
    /// SGLang's get_page_buffer_meta (or split-heads meta) for a host pool: {"ptrs","lens"}.
    #[command(after_help = META_EXAMPLES)]
    Meta(Box<MetaArgs>),
    /// SGLang's PD Mooncake connector plan over per-layer bases: {"srcs","dsts","lens"}.
    #[command(after_help = PD_PLAN_EXAMPLES)]
    PdPlan(Box<PdPlanArgs>),
    /// A transfer plan between two pools of any layouts and TP shards: {"srcs","dsts","lens"}.
    #[command(after_help = PLAN_EXAMPLES)]
    Plan(Box<PlanArgs>),
}

/// Model geometry shared by `meta` and `plan`: a preset (`--model`), or every flag by
/// hand; a flag given with a preset overrides the preset's value.
#[derive(Debug, Args)]
pub struct GeometryArgs {
    /// Model preset, the same as `bench pages --model`: llama3-8b, llama3-70b,
    /// deepseek-v3, mimo-v2. It sets --pool, --layers, --heads, --head-dim, --v-head-dim
    /// or --kv-dim, and defaults --page-size to 16 and --dtype-bytes to 2 (bf16).
    #[arg(long, value_enum, value_name = "MODEL")]
    model: Option<crate::bench::Preset>,
    /// Pool kind: mha | mha-split | mla.
    #[arg(long, value_name = "KIND")]
    pool: Option<String>,
    /// Number of layers.
    #[arg(long, value_name = "L")]
    layers: Option<String>,
    /// Tokens per page.
    #[arg(long, value_name = "P")]
    page_size: Option<String>,
    /// K head dim (mha, mha-split).
    #[arg(long, value_name = "D")]
    head_dim: Option<String>,
    /// V head dim (mha-split; defaults to the head dim).
    #[arg(long, value_name = "DV")]
    v_head_dim: Option<String>,
    /// MLA latent width (kv_lora_rank + qk_rope_head_dim).
    #[arg(long, value_name = "C")]
    kv_dim: Option<String>,
    /// Bytes per element.
    #[arg(long, value_name = "B")]
    dtype_bytes: Option<String>,
}

/// A repeated flag takes its last value (no multi-line clap error).
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct MetaArgs {
    #[command(flatten)]
    geometry: GeometryArgs,
    /// layer_first | page_first | page_first_direct | page_head.
    #[arg(long, value_name = "LAYOUT")]
    layout: Option<String>,
    /// Capacity in token slots.
    #[arg(long, value_name = "S")]
    capacity: Option<String>,
    /// Heads (mha, mha-split).
    #[arg(long, value_name = "H")]
    heads: Option<String>,
    /// Base address of the pool (the K buffer), decimal or 0x-hex.
    #[arg(long, value_name = "ADDR")]
    base: Option<String>,
    /// Base address of the V buffer (mha-split; for mha it defaults to base + L*S*H*D*b).
    #[arg(long, value_name = "ADDR")]
    v_base: Option<String>,
    /// Token slots: comma-separated numbers and half-open ranges a..b.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    indices: Option<String>,
    /// Split-heads list (page_head) with this split factor.
    #[arg(long, value_name = "F")]
    split_heads: Option<String>,
    /// Index checks: strict (default) or sglang (only what SGLang itself reads).
    #[arg(long, value_name = "MODE")]
    checks: Option<String>,
    /// Merge neighbouring runs per buffer (K runs, then V runs): not SGLang's shape.
    #[arg(long)]
    coalesce: bool,
    /// Only this layer's bytes of the pages, per buffer, merged (K runs, then V runs).
    #[arg(long, value_name = "N")]
    layer: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A repeated flag takes its last value (no multi-line clap error).
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct PdPlanArgs {
    /// Source per-layer K (or MLA) base addresses, comma-separated.
    #[arg(long, value_name = "ADDRS")]
    src_k: Option<String>,
    /// Destination per-layer K (or MLA) base addresses.
    #[arg(long, value_name = "ADDRS")]
    dst_k: Option<String>,
    /// Source per-layer V base addresses.
    #[arg(long, value_name = "ADDRS")]
    src_v: Option<String>,
    /// Destination per-layer V base addresses.
    #[arg(long, value_name = "ADDRS")]
    dst_v: Option<String>,
    /// Bytes of one page of one K layer (H*D*b*P, or C*b*P for MLA).
    #[arg(long, value_name = "N")]
    k_item_len: Option<String>,
    /// Bytes of one page of one V layer (H*Dv*b*P); defaults to the K item length.
    #[arg(long, value_name = "M")]
    v_item_len: Option<String>,
    /// Source pages: comma-separated numbers and half-open ranges a..b.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    src_pages: Option<String>,
    /// Destination pages, paired with the source pages.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    dst_pages: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A repeated flag takes its last value (no multi-line clap error).
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct PlanArgs {
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Heads of both pools (or use --src-heads/--dst-heads).
    #[arg(long, value_name = "H")]
    heads: Option<String>,
    /// Heads of the source pool (its TP shard).
    #[arg(long, value_name = "H")]
    src_heads: Option<String>,
    /// Heads of the destination pool (its TP shard).
    #[arg(long, value_name = "H")]
    dst_heads: Option<String>,
    /// Source TP rank (its heads are [rank*H, (rank+1)*H) of the model); default 0.
    #[arg(long, value_name = "R")]
    src_tp_rank: Option<String>,
    /// Destination TP rank; default 0.
    #[arg(long, value_name = "R")]
    dst_tp_rank: Option<String>,
    /// Source layout.
    #[arg(long, value_name = "LAYOUT")]
    src_layout: Option<String>,
    /// Destination layout.
    #[arg(long, value_name = "LAYOUT")]
    dst_layout: Option<String>,
    /// Source capacity in token slots.
    #[arg(long, value_name = "S")]
    src_capacity: Option<String>,
    /// Destination capacity in token slots.
    #[arg(long, value_name = "S")]
    dst_capacity: Option<String>,
    /// Source base address.
    #[arg(long, value_name = "ADDR")]
    src_base: Option<String>,
    /// Destination base address.
    #[arg(long, value_name = "ADDR")]
    dst_base: Option<String>,
    /// Source V base address.
    #[arg(long, value_name = "ADDR")]
    src_v_base: Option<String>,
    /// Destination V base address.
    #[arg(long, value_name = "ADDR")]
    dst_v_base: Option<String>,
    /// Source pages.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    src_pages: Option<String>,
    /// Destination pages, paired with the source pages.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    dst_pages: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: LayoutCommand) -> Result<()> {
    let out = match cmd {
        LayoutCommand::Meta(a) => meta(&a)?,
        LayoutCommand::PdPlan(a) => pd_plan(&a)?,
        LayoutCommand::Plan(a) => plan(&a)?,
    };
    print!("{out}");
    Ok(())
}

/// The most entries `meta` prints (2^26, about 1 GiB of JSON).
const MAX_ENTRIES: u64 = 1 << 26;

#[derive(Serialize)]
struct MetaJson<'a> {
    ptrs: &'a [u64],
    lens: &'a [u64],
}

#[derive(Serialize)]
struct PlanJson<'a> {
    srcs: &'a [u64],
    dsts: &'a [u64],
    lens: &'a [u64],
}

fn meta(a: &MetaArgs) -> Result<String> {
    let mut need = a.geometry.missing();
    for (v, flag) in [
        (&a.layout, "--layout"),
        (&a.capacity, "--capacity"),
        (&a.base, "--base"),
        (&a.indices, "--indices"),
    ] {
        if v.is_none() {
            need.push(flag);
        }
    }
    if a.heads.is_none() && a.geometry.needs_heads() {
        need.push("--heads");
    }
    missing(&need)?;
    let layout: Layout = parse_named(&a.layout, "--layout")?;
    let geometry = a.geometry.build(
        opt_u64(&a.heads, "--heads")?,
        req_u64(&a.capacity, "--capacity")?,
    )?;
    let base = req_parsed(&a.base, "--base", parse_addr)?;
    let v_base = opt_parsed(&a.v_base, "--v-base", parse_addr)?;
    let mut pool = Pool::new(geometry, layout, base, v_base)?;
    if let Some(c) = &a.checks {
        pool = pool.with_checks(match c.as_str() {
            "strict" => Checks::Strict,
            "sglang" => Checks::Sglang,
            _ => bail!("--checks: unknown mode {c:?} (expected strict or sglang)"),
        });
    }
    let indices = req_parsed(&a.indices, "--indices", parse_list)?;
    let split = opt_u64(&a.split_heads, "--split-heads")?;
    let layer = opt_u64(&a.layer, "--layer")?;
    if [split.is_some(), a.coalesce, layer.is_some()]
        .iter()
        .filter(|&&x| x)
        .count()
        > 1
    {
        bail!("--split-heads, --coalesce and --layer exclude each other");
    }

    // Refuse before generating an output nobody can read (absurd layer or head counts).
    let g = pool.geometry();
    let comps = pool.components().len() as u64;
    let per_page = match (split, layer) {
        (Some(f), _) => f.saturating_mul(comps),
        // At most one run per token and head of the layer (page_head).
        (_, Some(_)) => g
            .page_size()
            .saturating_mul(g.heads())
            .saturating_mul(comps),
        _ => pool.entries_per_page() as u64,
    };
    let bound = (indices.len() as u64 / g.page_size()).saturating_mul(per_page);
    if bound > MAX_ENTRIES {
        bail!("the request could produce {bound} entries (limit {MAX_ENTRIES})");
    }

    // Each entry with its buffer, for the table.
    let mut entries: Vec<(Component, Segment)> = Vec::new();
    let what;
    if let Some(f) = split {
        pool.for_each_split_heads_segment(&indices, f, |c, s| entries.push((c, s)))?;
        what = format!("split heads, factor {f}");
    } else if a.coalesce {
        for cs in pool.coalesced_meta(&indices)? {
            entries.extend(cs.segments.iter().map(|&s| (cs.component, s)));
        }
        what = "coalesced per buffer (not SGLang's shape)".to_owned();
    } else if let Some(l) = layer {
        for cs in pool.layer_view(&indices, l)?.components {
            entries.extend(cs.segments.iter().map(|&s| (cs.component, s)));
        }
        what = format!("layer {l}, coalesced per buffer (not SGLang's shape)");
    } else {
        pool.for_each_segment(&indices, |c, s| entries.push((c, s)))?;
        what = "get_page_buffer_meta".to_owned();
    }
    let segs: Segments = entries.iter().map(|&(_, s)| s).collect();
    if a.json {
        return json_line(&MetaJson {
            ptrs: &segs.ptrs,
            lens: &segs.lens,
        });
    }

    let g = pool.geometry();
    let sglang = match (split, a.coalesce || layer.is_some()) {
        (_, true) => "pagewire view",
        (Some(_), _) if pool.sglang_has_split_heads() => "SGLang-exact",
        (None, _) if pool.sglang_has_meta() => "SGLang-exact",
        _ => "extension: SGLang refuses this",
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} pool, {} layout, {what} [{sglang}]",
        g.kind(),
        pool.layout()
    );
    let _ = writeln!(out, "{}", geometry_line(g));
    for &c in pool.components() {
        let b = pool.buffer(c);
        let _ = writeln!(
            out,
            "buffer {c}: {:#x}..{:#x} ({} bytes)",
            b.addr,
            b.end(),
            b.len
        );
    }
    let _ = writeln!(
        out,
        "{:>6}  {:>3}  {:>18}  {:>12}",
        "#", "buf", "ptr", "len"
    );
    for (i, (c, s)) in entries.iter().enumerate() {
        let _ = writeln!(
            out,
            "{i:>6}  {:>3}  {:>#18x}  {:>12}",
            c.as_str(),
            s.addr,
            s.len
        );
    }
    let _ = writeln!(out, "{} entries, {} bytes", segs.len(), segs.total_bytes());
    Ok(out)
}

fn pd_plan(a: &PdPlanArgs) -> Result<String> {
    let mut need = Vec::new();
    for (v, flag) in [
        (&a.src_k, "--src-k"),
        (&a.dst_k, "--dst-k"),
        (&a.k_item_len, "--k-item-len"),
        (&a.src_pages, "--src-pages"),
        (&a.dst_pages, "--dst-pages"),
    ] {
        if v.is_none() {
            need.push(flag);
        }
    }
    missing(&need)?;
    let src_k = req_parsed(&a.src_k, "--src-k", parse_addrs)?;
    let dst_k = req_parsed(&a.dst_k, "--dst-k", parse_addrs)?;
    let k_item = req_u64(&a.k_item_len, "--k-item-len")?;
    let (src_v, dst_v) = match (&a.src_v, &a.dst_v) {
        (Some(s), Some(d)) => (
            parse_addrs(s).context("--src-v")?,
            parse_addrs(d).context("--dst-v")?,
        ),
        (None, None) => (Vec::new(), Vec::new()),
        (Some(_), None) => bail!("--src-v needs --dst-v"),
        (None, Some(_)) => bail!("--dst-v needs --src-v"),
    };
    let v_item = match opt_u64(&a.v_item_len, "--v-item-len")? {
        Some(_) if src_v.is_empty() => bail!("--v-item-len needs --src-v and --dst-v"),
        Some(v) => v,
        None => k_item,
    };
    let src_pages = req_parsed(&a.src_pages, "--src-pages", parse_list)?;
    let dst_pages = req_parsed(&a.dst_pages, "--dst-pages", parse_list)?;
    let mut groups = vec![PdBuffers {
        src: &src_k,
        dst: &dst_k,
        item_len: k_item,
    }];
    if !src_v.is_empty() || !dst_v.is_empty() {
        groups.push(PdBuffers {
            src: &src_v,
            dst: &dst_v,
            item_len: v_item,
        });
    }
    let plan = pd_connector_plan(&groups, &src_pages, &dst_pages)?;
    if a.json {
        return plan_json(&plan);
    }
    Ok(plan_table(
        &format!(
            "PD Mooncake connector plan: {} layer group(s), {} page pair(s) [SGLang-exact]\n",
            groups.len(),
            src_pages.len()
        ),
        &plan,
    ))
}

fn plan(a: &PlanArgs) -> Result<String> {
    let mut need = a.geometry.missing();
    for (v, flag) in [
        (&a.src_layout, "--src-layout"),
        (&a.dst_layout, "--dst-layout"),
        (&a.src_capacity, "--src-capacity"),
        (&a.dst_capacity, "--dst-capacity"),
        (&a.src_base, "--src-base"),
        (&a.dst_base, "--dst-base"),
        (&a.src_pages, "--src-pages"),
        (&a.dst_pages, "--dst-pages"),
    ] {
        if v.is_none() {
            need.push(flag);
        }
    }
    missing(&need)?;
    let (hs, hd) = match (&a.heads, &a.src_heads, &a.dst_heads) {
        (h, None, None) => (opt_u64(h, "--heads")?, opt_u64(h, "--heads")?),
        (None, s, d) => (opt_u64(s, "--src-heads")?, opt_u64(d, "--dst-heads")?),
        _ => bail!("--heads excludes --src-heads and --dst-heads"),
    };
    let src = a.pool(Side::Src, hs)?;
    let dst = a.pool(Side::Dst, hd)?;
    let (gs, gd) = (*src.geometry(), *dst.geometry());
    let shards = HeadShards::from_tp_ranks(
        &src,
        opt_u64(&a.src_tp_rank, "--src-tp-rank")?.unwrap_or(0),
        &dst,
        opt_u64(&a.dst_tp_rank, "--dst-tp-rank")?.unwrap_or(0),
    )?;
    let src_pages = req_parsed(&a.src_pages, "--src-pages", parse_list)?;
    let dst_pages = req_parsed(&a.dst_pages, "--dst-pages", parse_list)?;
    let plan = plan_with_heads(&src, &dst, &src_pages, &dst_pages, shards)?;
    if a.json {
        return plan_json(&plan);
    }
    Ok(plan_table(
        &format!(
            "plan {} {} -> {} {}, {} page pair(s)\nsource:      {}\ndestination: {}\n",
            gs.kind(),
            src.layout(),
            gd.kind(),
            dst.layout(),
            src_pages.len(),
            geometry_line(&gs),
            geometry_line(&gd)
        ),
        &plan,
    ))
}

#[derive(Clone, Copy)]
enum Side {
    Src,
    Dst,
}

impl PlanArgs {
    /// The source or destination pool, from that side's `--src-*` / `--dst-*` options.
    fn pool(&self, side: Side, heads: Option<u64>) -> Result<Pool> {
        let (f, what, capacity, layout, base, v_base) = match side {
            Side::Src => (
                "src",
                "source pool",
                &self.src_capacity,
                &self.src_layout,
                &self.src_base,
                &self.src_v_base,
            ),
            Side::Dst => (
                "dst",
                "destination pool",
                &self.dst_capacity,
                &self.dst_layout,
                &self.dst_base,
                &self.dst_v_base,
            ),
        };
        let capacity = req_u64(capacity, &format!("--{f}-capacity"))?;
        let g = self.geometry.build(heads, capacity).context(what)?;
        Pool::new(
            g,
            parse_named(layout, &format!("--{f}-layout"))?,
            req_parsed(base, &format!("--{f}-base"), parse_addr)?,
            opt_parsed(v_base, &format!("--{f}-v-base"), parse_addr)?,
        )
        .context(what)
    }
}

/// The preset's values as the flags would give them: (pool, layers, heads, head_dim,
/// v_head_dim, kv_dim).
type PresetGeometry = (
    &'static str,
    u64,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
);

fn preset_geometry(m: crate::bench::Preset) -> PresetGeometry {
    let (kind, layers, heads, d, dv) = m.shape();
    match kind {
        PoolKind::Mla => ("mla", layers, None, None, None, Some(d)),
        PoolKind::MhaSplit => ("mha-split", layers, Some(heads), Some(d), Some(dv), None),
        _ => ("mha", layers, Some(heads), Some(d), None, None),
    }
}

/// Page size and element bytes a preset implies unless told (as `bench pages`).
const PRESET_PAGE_SIZE: u64 = 16;
const PRESET_DTYPE_BYTES: u64 = 2;

impl GeometryArgs {
    /// Required geometry flags that are missing (none with a preset).
    fn missing(&self) -> Vec<&'static str> {
        if self.model.is_some() {
            return Vec::new();
        }
        [
            (&self.pool, "--pool"),
            (&self.layers, "--layers"),
            (&self.page_size, "--page-size"),
            (&self.dtype_bytes, "--dtype-bytes"),
        ]
        .into_iter()
        .filter(|(v, _)| v.is_none())
        .map(|(_, f)| f)
        .collect()
    }

    /// Whether the heads must come from a flag (an MHA pool without a preset).
    fn needs_heads(&self) -> bool {
        self.model.is_none() && self.pool.as_deref().is_some_and(|p| p != "mla")
    }

    fn build(&self, heads: Option<u64>, capacity: u64) -> Result<PoolGeometry> {
        let preset = self.model.map(preset_geometry);
        let kind: PoolKind = match (&self.pool, preset) {
            (None, Some((p, ..))) => p.parse().expect("preset pool kinds parse"),
            (v, _) => parse_named(v, "--pool")?,
        };
        let or = |v: Option<u64>, d: Option<u64>| v.or(d);
        let layers = or(opt_u64(&self.layers, "--layers")?, preset.map(|p| p.1));
        let page_size = or(
            opt_u64(&self.page_size, "--page-size")?,
            preset.map(|_| PRESET_PAGE_SIZE),
        );
        let dtype_bytes = or(
            opt_u64(&self.dtype_bytes, "--dtype-bytes")?,
            preset.map(|_| PRESET_DTYPE_BYTES),
        );
        let (Some(layers), Some(page_size), Some(dtype_bytes)) = (layers, page_size, dtype_bytes)
        else {
            return Err(missing(&self.missing()).expect_err("a geometry flag is missing"));
        };
        let mut b = PoolGeometry::builder(kind)
            .layers(layers)
            .page_size(page_size)
            .dtype_bytes(dtype_bytes)
            .capacity(capacity);
        if let Some(h) = heads.or(preset.and_then(|p| p.2)) {
            b = b.heads(h);
        }
        if let Some(d) = or(
            opt_u64(&self.head_dim, "--head-dim")?,
            preset.and_then(|p| p.3),
        ) {
            b = b.head_dim(d);
        }
        if let Some(d) = or(
            opt_u64(&self.v_head_dim, "--v-head-dim")?,
            preset.and_then(|p| p.4),
        ) {
            b = b.v_head_dim(d);
        }
        if let Some(c) = or(opt_u64(&self.kv_dim, "--kv-dim")?, preset.and_then(|p| p.5)) {
            b = b.kv_dim(c);
        }
        Ok(b.build()?)
    }
}

/// One error that names every missing flag at once.
fn missing(flags: &[&str]) -> Result<()> {
    match flags {
        [] => Ok(()),
        [one] => bail!("{one} is required (see --help for examples)"),
        many => bail!("{} are required (see --help for examples)", many.join(", ")),
    }
}

fn geometry_line(g: &PoolGeometry) -> String {
    let dims = match g.kv_dim() {
        Some(c) => format!("C={c}"),
        None => format!("H={} D={} Dv={}", g.heads(), g.head_dim(), g.v_head_dim()),
    };
    format!(
        "L={} P={} {dims} b={} S={} ({} pages)",
        g.layers(),
        g.page_size(),
        g.dtype_bytes(),
        g.capacity(),
        g.pages()
    )
}

fn plan_json(plan: &TransferPlan) -> Result<String> {
    json_line(&PlanJson {
        srcs: plan.srcs(),
        dsts: plan.dsts(),
        lens: plan.lens(),
    })
}

fn plan_table(header: &str, plan: &TransferPlan) -> String {
    let mut out = header.to_owned();
    let _ = writeln!(
        out,
        "{:>6}  {:>18}  {:>18}  {:>12}",
        "#", "src", "dst", "len"
    );
    for (i, t) in plan.iter().enumerate() {
        let _ = writeln!(
            out,
            "{i:>6}  {:>#18x}  {:>#18x}  {:>12}",
            t.src, t.dst, t.len
        );
    }
    let _ = writeln!(
        out,
        "{} transfers, {} bytes",
        plan.len(),
        plan.total_bytes()
    );
    out
}

fn json_line(v: &impl Serialize) -> Result<String> {
    let mut s = serde_json::to_string(v)?;
    s.push('\n');
    Ok(s)
}

fn req<'a>(v: &'a Option<String>, flag: &str) -> Result<&'a str> {
    match v {
        Some(s) => Ok(s),
        None => bail!("{flag} is required"),
    }
}

/// The required `flag` through `parse`, errors naming the flag.
fn req_parsed<T>(v: &Option<String>, flag: &str, parse: fn(&str) -> Result<T>) -> Result<T> {
    parse(req(v, flag)?).with_context(|| flag.to_owned())
}

/// The optional `flag` through `parse`, errors naming the flag.
fn opt_parsed<T>(
    v: &Option<String>,
    flag: &str,
    parse: fn(&str) -> Result<T>,
) -> Result<Option<T>> {
    v.as_deref()
        .map(|s| parse(s).with_context(|| flag.to_owned()))
        .transpose()
}

fn req_u64(v: &Option<String>, flag: &str) -> Result<u64> {
    req_parsed(v, flag, parse_u64)
}

fn opt_u64(v: &Option<String>, flag: &str) -> Result<Option<u64>> {
    opt_parsed(v, flag, parse_u64)
}

fn parse_named<T>(v: &Option<String>, flag: &str) -> Result<T>
where
    T: std::str::FromStr<Err = pagewire_layout::LayoutError>,
{
    req(v, flag)?.parse::<T>().with_context(|| flag.to_owned())
}

/// A decimal integer.
fn parse_u64(s: &str) -> Result<u64> {
    let t = s.trim();
    t.parse::<u64>()
        .with_context(|| format!("{t:?} is not a non-negative integer"))
}

/// A decimal or `0x`-hex address.
fn parse_addr(s: &str) -> Result<u64> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse::<u64>(),
    };
    r.with_context(|| format!("{t:?} is not an address (decimal or 0x-hex)"))
}

/// Comma-separated addresses.
fn parse_addrs(s: &str) -> Result<Vec<u64>> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',').map(parse_addr).collect()
}

/// Comma-separated integers and half-open ranges `a..b`.
fn parse_list(s: &str) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    if s.trim().is_empty() {
        return Ok(out);
    }
    for item in s.split(',') {
        let item = item.trim();
        if let Some((a, b)) = item.split_once("..") {
            let (a, b) = (parse_u64(a)?, parse_u64(b)?);
            if a > b {
                bail!("range {item:?} runs backwards");
            }
            // Refuse absurd lists before allocating them.
            if b - a > (1 << 28) - out.len() as u64 {
                bail!("more than 2^28 entries (at {item:?})");
            }
            out.extend(a..b);
        } else {
            if out.len() >= 1 << 28 {
                bail!("more than 2^28 entries (at {item:?})");
            }
            out.push(parse_u64(item)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_addresses() {
        assert_eq!(parse_list("8..12, 20,21").unwrap(), [8, 9, 10, 11, 20, 21]);
        assert_eq!(parse_list("").unwrap(), Vec::<u64>::new());
        assert!(parse_list("3..1").is_err());
        assert!(parse_list("1,,2").is_err());
        assert!(parse_list("-1").is_err());
        // Refused before allocating.
        assert!(parse_list("0..268435457").is_err());
        assert_eq!(parse_addr("0x1000").unwrap(), 4096);
        assert_eq!(parse_addr("4096").unwrap(), 4096);
        assert!(parse_addr("0x").is_err());
        assert!(parse_addr("0x1_0000_0000_0000_0000").is_err());
        assert_eq!(parse_addrs("0x10,16").unwrap(), [16, 16]);
    }
}
