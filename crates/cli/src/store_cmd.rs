//! `pagewire store master|serve|client`: the KV page store's master, storage nodes and
//! standalone clients (`pagewire-store`). The benchmark is `pagewire bench store`.
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use pagewire_ha::{HaConfig, HaMaster};
use pagewire_store::{
    ClientConfig, IpcAddr, Master, MasterConfig, RealClient, RealClientConfig, StoreClient,
};
use pagewire_transport::{BackendKind, EngineConfig};

/// The transport a storage node serves its segment over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// verbs if an RDMA device is usable, else TCP.
    Auto,
    /// RDMA verbs.
    Verbs,
    /// TCP streams.
    Tcp,
}

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Run the master: membership, object metadata, allocation, leases, eviction.
    ///
    /// Example: pagewire store master --listen 0.0.0.0:50051
    ///
    /// With --ha etcd://h1:2379;h2:2379 several masters elect a leader through etcd; the
    /// others stand by (they accept no client) until it fails. With --shards S --shard i
    /// the key space is split over S leader groups and this master campaigns in group i.
    Master(MasterArgs),
    /// Run a storage node: allocate and register a segment, offer it to the master.
    ///
    /// Example: pagewire store serve --master 10.0.0.1:50051 --segment 8G
    /// (--master etcd://h1:2379;h2:2379 follows the leader elected through etcd)
    Serve(ServeArgs),
    /// Run a standalone client: a storage node that also serves dummy clients of this
    /// host (Mooncake's `mooncake_client`; `setup_dummy(..., server_address)` connects).
    ///
    /// Example: pagewire store client --master 10.0.0.1:50051 --segment 8G --address 127.0.0.1:50052
    Client(ClientArgs),
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    #[command(flatten)]
    pub node: ServeArgs,
    /// Where dummy clients connect: `host:port` (Mooncake's `server_address`; stands for
    /// the abstract socket `@pagewire_client_<port>.sock`), `@name`, or `unix:/path`.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub address: String,
    /// Most dummy clients connected at once.
    #[arg(long, default_value_t = 64)]
    pub max_dummies: usize,
}

#[derive(Debug, Args)]
pub struct MasterArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Read lease length in milliseconds (a leased object is neither removed nor evicted).
    #[arg(long, default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
    /// Silence after which a client is dropped and its segments unmounted (ms).
    #[arg(long, default_value_t = 10_000)]
    pub client_ttl_ms: u64,
    /// Heartbeat period asked of clients (ms; at most half the client TTL).
    #[arg(long, default_value_t = 1_000)]
    pub heartbeat_ms: u64,
    /// Usage fraction at which eviction starts.
    #[arg(long, default_value_t = 0.90)]
    pub high_watermark: f64,
    /// Fraction of the capacity one eviction round frees.
    #[arg(long, default_value_t = 0.05)]
    pub evict_ratio: f64,
    /// A put unfinished after this long is taken away from its writer (ms).
    #[arg(long, default_value_t = 30_000)]
    pub put_discard_ms: u64,
    /// Space of such a put is reused this long after the put started (ms).
    #[arg(long, default_value_t = 600_000)]
    pub put_release_ms: u64,
    /// Elect the master through etcd: `etcd://HOST:PORT[;HOST:PORT...]`. Masters with the
    /// same etcd and --cluster-id elect one leader; the others stand by. For an etcd with
    /// authentication on, set PAGEWIRE_ETCD_USER and PAGEWIRE_ETCD_PASSWORD (or
    /// PAGEWIRE_ETCD_PASSWORD_FILE).
    #[arg(long)]
    pub ha: Option<String>,
    /// With --ha: the masters' group in etcd.
    #[arg(long, default_value = "default")]
    pub cluster_id: String,
    /// With --ha: the leader's etcd lease in seconds (a dead leader is replaced within
    /// about this time; at least 2; it must outlast an election among etcd's members).
    #[arg(long, default_value_t = 5)]
    pub ha_lease_s: u64,
    /// With --ha: op-log entries between two snapshots of the metadata in etcd (the
    /// entries a snapshot covers are then deleted and etcd's history compacted).
    #[arg(long, default_value_t = pagewire_ha::DEFAULT_SNAPSHOT_EVERY)]
    pub snapshot_every: u64,
    /// With --ha: the address clients reach this master at, written in etcd when it
    /// leads (default: --listen, which must then not be 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// With --ha: shards (leader groups) the cluster's key space is split over. The first
    /// master writes the count to etcd; a master given another count refuses to start.
    #[arg(long, default_value_t = 1)]
    pub shards: usize,
    /// With --ha and --shards: the shard whose leader group this master campaigns in
    /// (0 to shards - 1).
    #[arg(long, default_value_t = 0)]
    pub shard: usize,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The master's host:port, or `etcd://HOST:PORT[;HOST:PORT...]` to follow the leader
    /// of masters elected through etcd (etcd's user and password, if any, from
    /// PAGEWIRE_ETCD_USER and PAGEWIRE_ETCD_PASSWORD or PAGEWIRE_ETCD_PASSWORD_FILE).
    #[arg(long)]
    pub master: String,
    /// With an etcd:// master: the masters' group in etcd.
    #[arg(long, default_value = "default")]
    pub cluster_id: String,
    /// Bytes of memory to offer (suffixes K, M, G, T = powers of 1024).
    #[arg(long, value_parser = parse_bytes)]
    pub segment: u64,
    /// Transport listener (ip:port). With an unspecified IP the node announces the
    /// address it reaches the master from.
    #[arg(long, default_value = "0.0.0.0:0")]
    pub listen: SocketAddr,
    /// Transport backend.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    pub transport: Transport,
    /// RDMA device.
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// GID index.
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,
}

/// `1024`, `64K`, `8G`, `1T` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected bytes such as 4096, 64M or 8G"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("invalid size {s:?}: unknown unit {unit:?}")),
    };
    let v = n
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} overflows"))?;
    if v == 0 {
        return Err("size must be positive".into());
    }
    Ok(v)
}

pub fn run(cmd: StoreCommand) -> anyhow::Result<()> {
    match cmd {
        StoreCommand::Master(a) => master(a),
        StoreCommand::Serve(a) => {
            let node = join(&a)?;
            println!("pagewire store serve: {}", describe(&a, &node)?);
            park()
        }
        StoreCommand::Client(a) => client(a),
    }
}

fn master(a: MasterArgs) -> anyhow::Result<()> {
    let mut cfg = MasterConfig {
        listen: a.listen,
        token: std::env::var("PAGEWIRE_TOKEN").ok().map(String::into_bytes),
        ..MasterConfig::default()
    };
    let c = &mut cfg.core;
    c.lease_ttl_ms = a.lease_ttl_ms;
    c.client_ttl_ms = a.client_ttl_ms;
    c.heartbeat_ms = a.heartbeat_ms;
    c.high_watermark = a.high_watermark;
    c.evict_ratio = a.evict_ratio;
    c.put_discard_ms = a.put_discard_ms;
    c.put_release_ms = a.put_release_ms;
    if let Some(etcd) = &a.ha {
        let mut ha = HaConfig::new(etcd.clone());
        ha.cluster_id.clone_from(&a.cluster_id);
        ha.lease_ttl = Duration::from_secs(a.ha_lease_s);
        ha.snapshot_every = a.snapshot_every;
        ha.advertise.clone_from(&a.advertise);
        let m = HaMaster::start_shard(cfg, ha, a.shards, a.shard)
            .context("starting the store master on etcd")?;
        println!(
            "pagewire store master: listening on {} (lease {} ms, client TTL {} ms), \
             campaigning through {etcd} as cluster {:?}{}",
            m.local_addr(),
            a.lease_ttl_ms,
            a.client_ttl_ms,
            a.cluster_id,
            if a.shards > 1 {
                format!(", shard {} of {}", a.shard, a.shards)
            } else {
                String::new()
            }
        );
        m.wait();
        return Ok(());
    }
    anyhow::ensure!(
        a.shards == 1 && a.shard == 0,
        "--shards and --shard need --ha: shards are leader groups on etcd"
    );
    let m = Master::start(cfg).context("starting the store master")?;
    println!(
        "pagewire store master: listening on {} (lease {} ms, client TTL {} ms, eviction at {:.0} %)",
        m.local_addr(),
        a.lease_ttl_ms,
        a.client_ttl_ms,
        a.high_watermark * 100.0
    );
    m.wait();
    Ok(())
}

/// Opens the engine, allocates and registers the segment, and joins the store.
fn join(a: &ServeArgs) -> anyhow::Result<StoreClient> {
    let mut b = EngineConfig::builder()
        .with_env()?
        .backend(match a.transport {
            Transport::Auto => BackendKind::Auto,
            Transport::Verbs => BackendKind::Verbs,
            Transport::Tcp => BackendKind::Tcp,
        })
        .listen(a.listen);
    if let Some(d) = &a.device {
        b = b.rdma_device(d.clone());
    }
    if let Some(x) = a.gid_index {
        b = b.gid_index(x);
    }
    let mut cfg = store_client_config(&a.master, &a.cluster_id)?;
    cfg.engine = b.build()?;
    cfg.segment_size = a.segment;
    cfg.token = std::env::var("PAGEWIRE_TOKEN").ok();
    StoreClient::connect(cfg).with_context(|| format!("joining the store at {}", a.master))
}

fn describe(a: &ServeArgs, node: &StoreClient) -> anyhow::Result<String> {
    let info = node.engine().backend_info();
    Ok(format!(
        "{} segment at {} ({} {}), mounted on {} as segment {}",
        human(a.segment),
        node.endpoint(),
        info.kind,
        info.device,
        a.master,
        node.segment_id()?
            .map_or_else(|| "?".into(), |s| s.to_string())
    ) + &if node.shards() > 1 {
        format!(
            " on shard 0; carved into {} parts, part i mounted on shard i",
            node.shards()
        )
    } else {
        String::new()
    })
}

/// The heartbeat thread keeps the segment mounted (and mounts it again after a master
/// restart); this thread only waits. Stopping the process unmounts it at the master after
/// the client TTL.
fn park() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn client(a: ClientArgs) -> anyhow::Result<()> {
    let address: IpcAddr = a.address.parse()?;
    let node = join(&a.node)?;
    let line = describe(&a.node, &node)?;
    // The store client's one token (PAGEWIRE_TOKEN) guards the dummy endpoint too.
    let mut cfg = RealClientConfig::new(address);
    cfg.max_dummies = a.max_dummies;
    let real = RealClient::start(node, cfg)
        .with_context(|| format!("listening for dummy clients on {}", a.address))?;
    println!(
        "pagewire store client: {line}; dummy clients at {} (server_address {})",
        real.address(),
        a.address
    );
    park()
}

/// Client settings for `--master`: a `host:port`, or an `etcd://` address whose leader
/// the client follows.
pub fn store_client_config(master: &str, cluster_id: &str) -> anyhow::Result<ClientConfig> {
    let by = std::time::Instant::now() + Duration::from_secs(10);
    pagewire_ha::client_config(master, cluster_id, by)
        .with_context(|| format!("connecting to {master}"))
}

fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("2TiB"), Ok(2 << 40));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("5Q").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
