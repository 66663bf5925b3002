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

#[derive(Debug, Subcommand)]
pub enum LayoutCommand {
    /// SGLang's get_page_buffer_meta (or split-heads meta) for a host pool: {"ptrs","lens"}.
    Meta(Box<MetaArgs>),
    /// SGLang's PD Mooncake connector plan over per-layer bases: {"srcs","dsts","lens"}.
    PdPlan(Box<PdPlanArgs>),
    /// A transfer plan between two pools of any layouts and TP shards: {"srcs","dsts","lens"}.
    Plan(Box<PlanArgs>),
}

/// Model geometry shared by `meta` and `plan`.
#[derive(Debug, Args)]
pub struct GeometryArgs {
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

impl GeometryArgs {
    fn build(&self, heads: Option<u64>, capacity: u64) -> Result<PoolGeometry> {
        let kind: PoolKind = parse_named(&self.pool, "--pool")?;
        let mut b = PoolGeometry::builder(kind)
            .layers(req_u64(&self.layers, "--layers")?)
            .page_size(req_u64(&self.page_size, "--page-size")?)
            .dtype_bytes(req_u64(&self.dtype_bytes, "--dtype-bytes")?)
            .capacity(capacity);
        if let Some(h) = heads {
            b = b.heads(h);
        }
        if let Some(d) = opt_u64(&self.head_dim, "--head-dim")? {
            b = b.head_dim(d);
        }
        if let Some(d) = opt_u64(&self.v_head_dim, "--v-head-dim")? {
            b = b.v_head_dim(d);
        }
        if let Some(c) = opt_u64(&self.kv_dim, "--kv-dim")? {
            b = b.kv_dim(c);
        }
        Ok(b.build()?)
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
