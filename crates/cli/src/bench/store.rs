//! `pagewire bench store`: put and get throughput and latency of batches of KV pages
//! through the store (`pagewire-store`), as SGLang's HiCache moves them: one object per
//! page and component (`{hash}_{tp}_k`, `{hash}_{tp}_v`; `{hash}__k` for MLA), pointers
//! from a `page_first` host pool computed by the layout crate.
//!
//! Each iteration puts one batch of fresh keys from the source pool (timed) and gets it
//! back into the destination pool (timed). Keys are not removed: a read leases its objects
//! for the lease TTL and a forced removal of a leased object frees its space only when the
//! lease ends, so the store must hold every batch of the run (the in-process node is sized
//! for that; with `--master`, eviction makes room only from objects whose leases ended).
//! Without `--master`, a master and one storage node run in this process and the client
//! still goes through the transport (no local copy).
use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{Context, ensure};
use clap::Args;
use pagewire_layout::{Layout, Pool, PoolGeometry, PoolKind};
use pagewire_store::{ClientConfig, Master, MasterConfig, PutOptions, Span, StoreClient};
use pagewire_transport::EngineConfig;

use super::args::TransportArg;
use super::pages::{Dtype, Preset};
use super::session::backend_kind;
use super::stats::percentile;

#[derive(Debug, Clone, Args)]
pub struct StoreBenchArgs {
    /// The store master's host:port, or `etcd://HOST:PORT[;HOST:PORT...]` to follow the
    /// leader of masters elected through etcd (its user, if any, from PAGEWIRE_ETCD_USER
    /// and PAGEWIRE_ETCD_PASSWORD). Without it a master and one storage node run in this
    /// process.
    #[arg(long)]
    pub master: Option<String>,

    /// With an etcd:// master: the masters' group in etcd.
    #[arg(long, default_value = "default")]
    pub cluster_id: String,

    /// Model preset (KV geometry).
    #[arg(long, value_enum, default_value_t = Preset::Llama3_8b)]
    pub model: Preset,

    /// Element type.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,

    /// Override the preset's layer count.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub layers: Option<u64>,

    /// Tokens per page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub page_size: u64,

    /// Pages per batch (SGLang's HiCache sends up to 128).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub pages: u64,

    /// Measured batches (each: one put, one get).
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub iters: u64,

    /// Unmeasured batches first (connections, first-touch of memory).
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,

    /// Clients putting and getting at the same time, each with its own engine, pools and
    /// keys (one thread each). MiB/s is then the sum of the clients' rates; latencies are
    /// pooled over all of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub clients: u64,

    /// Replicas per object.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub replicas: u8,

    /// Transport backend.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,

    /// RDMA device.
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,

    /// GID index.
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,

    /// Segment of the in-process storage node (default: every batch of the run, replicas
    /// included, plus 1/8).
    #[arg(long, value_parser = crate::store_cmd::parse_bytes)]
    pub segment: Option<u64>,

    /// The client engine's listen address (default: 0.0.0.0:0 with --master, where storage
    /// nodes may be elsewhere; 127.0.0.1:0 without).
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,

    /// Check every byte read back against what was put.
    #[arg(long)]
    pub verify: bool,

    /// One JSON record on stdout instead of the text report (no progress bar).
    #[arg(long)]
    pub json: bool,
}

fn geometry(a: &StoreBenchArgs) -> anyhow::Result<PoolGeometry> {
    let (kind, layers, heads, d, dv) = a.model.shape();
    let b = PoolGeometry::builder(kind)
        .layers(a.layers.unwrap_or(layers))
        .page_size(a.page_size)
        .dtype_bytes(a.dtype.bytes())
        .capacity(a.pages * a.page_size);
    let b = match kind {
        PoolKind::Mla => b.kv_dim(d),
        PoolKind::MhaSplit => b.heads(heads).head_dim(d).v_head_dim(dv),
        _ => b.heads(heads).head_dim(d),
    };
    Ok(b.build()?)
}

/// A host pool: its memory (registered with the client) and its layout.
struct HostPool {
    mem: Vec<u8>,
    pool: Pool,
}

impl HostPool {
    fn new(g: PoolGeometry, c: &StoreClient) -> anyhow::Result<HostPool> {
        let (bytes, v_off) = super::pages::pool_bytes(&g);
        let mut mem = vec![0u8; usize::try_from(bytes)?];
        let base = mem.as_mut_ptr() as u64;
        let pool = Pool::new(g, Layout::PageFirst, base, v_off.map(|o| base + o))?;
        // SAFETY: the vector is neither freed nor reallocated before the client closes
        // (`run` closes the client before the pools drop).
        unsafe { c.register_buffer(mem.as_mut_ptr(), mem.len()) }?;
        Ok(HostPool { mem, pool })
    }

    /// Per object of the batch: its (ptr, len), in SGLang's pointer order.
    fn objects(&self, pages: u64) -> anyhow::Result<Vec<Span>> {
        let all: Vec<u64> = (0..pages).collect();
        let m = self.pool.page_meta_for_pages(&all)?;
        Ok(m.iter().map(|s| Span::new(s.addr, s.len)).collect())
    }
}

/// SGLang's key names for one page's components (tp rank 0, no pipeline parallelism).
fn page_keys(kind: PoolKind, hash: &str) -> Vec<String> {
    match kind {
        PoolKind::Mla => vec![format!("{hash}__k")],
        _ => vec![format!("{hash}_0_k"), format!("{hash}_0_v")],
    }
}

#[derive(Debug, Clone, serde::Serialize)]
struct OpStats {
    batches: u64,
    bytes_per_batch: u64,
    mib_s: f64,
    gbit_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    min_ms: f64,
    max_ms: f64,
}

fn op_stats(lat: &mut [f64], bytes: u64) -> OpStats {
    lat.sort_by(f64::total_cmp);
    let total: f64 = lat.iter().sum();
    let all = bytes as f64 * lat.len() as f64;
    OpStats {
        batches: lat.len() as u64,
        bytes_per_batch: bytes,
        mib_s: all / total / (1 << 20) as f64,
        gbit_s: all * 8.0 / total / 1e9,
        p50_ms: percentile(lat, 50.0) * 1e3,
        p99_ms: percentile(lat, 99.0) * 1e3,
        min_ms: lat.first().copied().unwrap_or(0.0) * 1e3,
        max_ms: lat.last().copied().unwrap_or(0.0) * 1e3,
    }
}

fn engine_cfg(a: &StoreBenchArgs, listen: &str) -> anyhow::Result<EngineConfig> {
    let mut b = EngineConfig::builder()
        .with_env()
        .context("PAGEWIRE_* environment")?
        .backend(backend_kind(a.transport))
        .listen(listen.parse()?);
    if let Some(d) = &a.device {
        b = b.rdma_device(d.clone());
    }
    if let Some(x) = a.gid_index {
        b = b.gid_index(x);
    }
    Ok(b.build()?)
}

pub fn run(a: StoreBenchArgs) -> anyhow::Result<()> {
    let g = geometry(&a)?;
    ensure!(
        a.master.is_none() || a.transport != TransportArg::Loopback,
        "--transport loopback needs the storage node in this process (no --master)"
    );
    // One page's objects, to size the in-process segment.
    let per_batch: u64 = {
        let (bytes, _) = super::pages::pool_bytes(&g);
        bytes
    };
    let mut local: Option<(Master, StoreClient)> = None;
    let master_addr = match &a.master {
        Some(m) => m.clone(),
        None => {
            let m = Master::start(MasterConfig {
                listen: "127.0.0.1:0".parse()?,
                ..MasterConfig::default()
            })?;
            let mut nc = ClientConfig::new(m.local_addr().to_string());
            nc.engine = engine_cfg(&a, "127.0.0.1:0")?;
            let all = per_batch
                .saturating_mul(a.replicas as u64)
                .saturating_mul(a.clients)
                .saturating_mul(a.warmup + a.iters);
            nc.segment_size = a.segment.unwrap_or(all + all / 8);
            let node = StoreClient::connect(nc).context("in-process storage node")?;
            let addr = m.local_addr().to_string();
            local = Some((m, node));
            addr
        }
    };
    let mut cc = crate::store_cmd::store_client_config(&master_addr, &a.cluster_id)?;
    let listen = match (a.listen, &a.master) {
        (Some(l), _) => l.to_string(),
        (None, Some(_)) => "0.0.0.0:0".into(),
        (None, None) => "127.0.0.1:0".into(),
    };
    cc.engine = engine_cfg(&a, &listen)?;
    cc.local_copy = false;
    let mut clients = Vec::new();
    for _ in 0..a.clients {
        let c = StoreClient::connect(cc.clone())
            .with_context(|| format!("joining the store at {master_addr}"))?;
        clients.push(c);
    }
    let r = bench(&a, &g, &clients, local.is_some());
    clients.iter().for_each(StoreClient::close);
    if let Some((m, node)) = local {
        node.close();
        m.shutdown();
    }
    r
}

/// What one client measured.
struct Measured {
    put_lat: Vec<f64>,
    get_lat: Vec<f64>,
    batch_bytes: u64,
    objects: usize,
    object_bytes: u64,
}

fn bench(
    a: &StoreBenchArgs,
    g: &PoolGeometry,
    clients: &[StoreClient],
    local: bool,
) -> anyhow::Result<()> {
    // Every client warms up, then all start their measured batches together.
    let start = std::sync::Barrier::new(clients.len());
    let runs: Vec<anyhow::Result<Measured>> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let start = &start;
                s.spawn(move || client_loop(a, g, c, i as u64, start))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client panicked")))
            })
            .collect()
    });
    let runs = runs.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let batch_bytes = runs[0].batch_bytes;
    let (mut put_lat, mut get_lat) = (Vec::new(), Vec::new());
    let (mut put_rate, mut get_rate) = (0.0, 0.0);
    for r in &runs {
        put_rate += rate(&r.put_lat, batch_bytes);
        get_rate += rate(&r.get_lat, batch_bytes);
        put_lat.extend_from_slice(&r.put_lat);
        get_lat.extend_from_slice(&r.get_lat);
    }
    let mut put = op_stats(&mut put_lat, batch_bytes);
    let mut get = op_stats(&mut get_lat, batch_bytes);
    for (st, bps) in [(&mut put, put_rate), (&mut get, get_rate)] {
        st.mib_s = bps / (1 << 20) as f64;
        st.gbit_s = bps * 8.0 / 1e9;
    }
    report(a, &clients[0], local, &runs[0], &put, &get)
}

/// Bytes per second of one client's batches of `bytes`, one after another.
fn rate(lat: &[f64], bytes: u64) -> f64 {
    bytes as f64 * lat.len() as f64 / lat.iter().sum::<f64>()
}

fn client_loop(
    a: &StoreBenchArgs,
    g: &PoolGeometry,
    client: &StoreClient,
    index: u64,
    start: &std::sync::Barrier,
) -> anyhow::Result<Measured> {
    let mut src = HostPool::new(*g, client)?;
    let mut dst = HostPool::new(*g, client)?;
    let src_objs = src.objects(a.pages)?;
    let dst_objs = dst.objects(a.pages)?;
    let batch_bytes: u64 = src_objs.iter().map(|s| s.len).sum();
    let run_id = std::process::id() as u64 ^ (Instant::now().elapsed().as_nanos() as u64) ^ 0x5eed;
    let opts = PutOptions {
        replicas: a.replicas,
        ..PutOptions::default()
    };
    let bar = (index == 0 && !a.json && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(a.warmup + a.iters);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} batches {msg}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        b.set_prefix("bench store");
        b
    });
    let (mut put_lat, mut get_lat) = (Vec::new(), Vec::new());
    for it in 0..a.warmup + a.iters {
        if it == a.warmup {
            start.wait();
        }
        let keys: Vec<String> = (0..a.pages)
            .flat_map(|p| {
                let hash = format!("{run_id:016x}{it:016x}{p:016x}{index:016x}");
                page_keys(g.kind(), &hash)
            })
            .collect();
        if a.verify {
            let seed = it as u8;
            src.mem
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i as u8) ^ seed.wrapping_mul(31));
            dst.mem.fill(0);
        }
        let src_parts: Vec<[Span; 1]> = src_objs.iter().map(|s| [*s]).collect();
        let t0 = Instant::now();
        let r = client.put(&keys, &src_parts, &opts)?;
        let dt_put = t0.elapsed();
        if let Some((i, e)) = r
            .iter()
            .enumerate()
            .find_map(|(i, x)| x.err().map(|e| (i, e)))
        {
            anyhow::bail!("put of {} failed: {e}", keys[i]);
        }
        let dst_parts: Vec<[Span; 1]> = dst_objs.iter().map(|s| [*s]).collect();
        let t0 = Instant::now();
        let r = client.get(&keys, &dst_parts)?;
        let dt_get = t0.elapsed();
        for (i, x) in r.iter().enumerate() {
            match x {
                Ok(n) if *n == dst_objs[i].len => {}
                Ok(n) => anyhow::bail!("get of {} returned {n} bytes", keys[i]),
                Err(e) => anyhow::bail!("get of {} failed: {e}", keys[i]),
            }
        }
        if a.verify {
            for (s, d) in src_objs.iter().zip(&dst_objs) {
                let so = (s.addr - src.mem.as_ptr() as u64) as usize;
                let d_off = (d.addr - dst.mem.as_ptr() as u64) as usize;
                ensure!(
                    src.mem[so..so + s.len as usize] == dst.mem[d_off..d_off + d.len as usize],
                    "batch {it}: bytes read back differ"
                );
            }
        }
        if it >= a.warmup {
            put_lat.push(dt_put.as_secs_f64());
            get_lat.push(dt_get.as_secs_f64());
        }
        if let Some(b) = &bar {
            b.inc(1);
            if it >= a.warmup {
                b.set_message(format!(
                    "put {:.0} MiB/s, get {:.0} MiB/s",
                    batch_bytes as f64 / dt_put.as_secs_f64() / (1 << 20) as f64,
                    batch_bytes as f64 / dt_get.as_secs_f64() / (1 << 20) as f64
                ));
            }
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(Measured {
        put_lat,
        get_lat,
        batch_bytes,
        objects: src_objs.len(),
        object_bytes: src_objs[0].len,
    })
}

fn report(
    a: &StoreBenchArgs,
    client: &StoreClient,
    local: bool,
    m: &Measured,
    put: &OpStats,
    get: &OpStats,
) -> anyhow::Result<()> {
    let info = client.engine().backend_info();
    let (obj, batch_bytes) = (m.object_bytes, m.batch_bytes);
    let per_page = m.objects / a.pages as usize;
    if a.json {
        let rec = serde_json::json!({
            "test": "store",
            "model": a.model.name(),
            "dtype": a.dtype.name(),
            "layout": "page_first",
            "page_size": a.page_size,
            "pages_per_batch": a.pages,
            "objects_per_batch": m.objects,
            "clients": a.clients,
            "object_bytes": obj,
            "batch_bytes": batch_bytes,
            "replicas": a.replicas,
            "transport": info.kind.to_string(),
            "device": info.device,
            "master": client.master(),
            "in_process": local,
            "verified": a.verify,
            "put": put,
            "get": get,
        });
        println!("{rec}");
        return Ok(());
    }
    println!(
        "pagewire bench store: {} {}, page_first, {} pages x {} tokens per batch = {} objects ({} per page) of {:.2} MiB, {:.1} MiB per batch, {} replica(s)",
        a.model.name(),
        a.dtype.name(),
        a.pages,
        a.page_size,
        m.objects,
        per_page,
        obj as f64 / (1 << 20) as f64,
        batch_bytes as f64 / (1 << 20) as f64,
        a.replicas
    );
    println!(
        " master {}{}; transport {}{}{}",
        client.master(),
        if local {
            " (in process, with one storage node)"
        } else {
            ""
        },
        info.kind,
        if info.kind == pagewire_transport::BackendKind::Verbs {
            format!(" {}", info.device)
        } else {
            String::new()
        },
        if a.verify {
            "; every byte verified"
        } else {
            ""
        }
    );
    println!(
        " {:<4} {:>8} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "op", "batches", "MiB/s", "Gbit/s", "p50 ms", "p99 ms", "min ms", "max ms"
    );
    if a.clients > 1 {
        println!(" {} clients at once: MiB/s is their sum", a.clients);
    }
    for (name, s) in [("put", put), ("get", get)] {
        println!(
            " {:<4} {:>8} {:>10.1} {:>8.2} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
            name, s.batches, s.mib_s, s.gbit_s, s.p50_ms, s.p99_ms, s.min_ms, s.max_ms
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_sglang() {
        assert_eq!(page_keys(PoolKind::Mha, "ab"), ["ab_0_k", "ab_0_v"]);
        assert_eq!(page_keys(PoolKind::MhaSplit, "ab"), ["ab_0_k", "ab_0_v"]);
        assert_eq!(page_keys(PoolKind::Mla, "ab"), ["ab__k"]);
    }

    #[test]
    fn percentiles_and_rates() {
        let mut lat = vec![0.002, 0.001, 0.004, 0.003];
        let s = op_stats(&mut lat, 1 << 20);
        assert_eq!(s.batches, 4);
        assert!((s.mib_s - 4.0 / 0.010).abs() < 1e-9);
        assert!((s.p50_ms - 2.0).abs() < 1e-9 && (s.max_ms - 4.0).abs() < 1e-9);
    }
}
