//! Engine configuration: a typed struct, a builder, and environment overrides.
//!
//! [`EngineConfig::builder`] starts from the defaults; [`EngineConfigBuilder::with_env`]
//! applies the environment variables below on top of what was set so far (call it last
//! so the environment wins, or first so code wins). [`EngineConfigBuilder::build`]
//! validates every value.
//!
//! | Variable | Field | Default | Meaning |
//! |---|---|---|---|
//! | `PAGEWIRE_TRANSPORT` | `backend` | `auto` | `auto`, `verbs`, `tcp` or `loopback` |
//! | `PAGEWIRE_LISTEN` | `listen` | `0.0.0.0:0` | control listener `ip:port` (port 0 = any) |
//! | `PAGEWIRE_TOKEN` | `token` | none | shared secret both sides must present |
//! | `PAGEWIRE_RDMA_DEVICE` | `rdma_device` | first usable | verbs device (`mlx5_0`), several to stripe over (`mlx5_0,mlx5_1:1:3`: `name[:port[:gid_index]]`), or `all` |
//! | `PAGEWIRE_RAIL_PRIORITY` | `rail_priority` | by topology | which rails serve which memory, by hand: `cpu:0=mlx5_0,mlx5_1/mlx5_2;cuda:0=mlx5_0` ([`RailPriority`]) |
//! | `PAGEWIRE_SYSFS_ROOT` | `sysfs_root` | `/sys` | where the rail choice reads the PCIe and NUMA topology (a recorded tree in tests) |
//! | `PAGEWIRE_IB_PORT` | `ib_port` | `1` | verbs port number |
//! | `PAGEWIRE_GID_INDEX` | `gid_index` | auto | GID table index (RoCE) |
//! | `PAGEWIRE_MTU` | `mtu` | port active MTU | path MTU cap: 256, 512, 1024, 2048 or 4096 |
//! | `PAGEWIRE_QPS_PER_PEER` | `qps_per_peer` | `2` | RC QPs per peer (1..=64) |
//! | `PAGEWIRE_TX_DEPTH` | `tx_depth` | `256` | send queue depth per QP |
//! | `PAGEWIRE_SIGNAL_EVERY` | `signal_every` | `16` | signal one WR in N (selective signalling) |
//! | `PAGEWIRE_MAX_WR_BYTES` | `max_wr_bytes` | `1 MiB` | slice size: the largest single WR / TCP chunk |
//! | `PAGEWIRE_MAX_MR_BYTES` | `max_mr_bytes` | device max | split registrations above this |
//! | `PAGEWIRE_TCP_STREAMS` | `tcp_streams` | `4` | TCP data streams per peer (1..=64) |
//! | `PAGEWIRE_HANDSHAKE_MAX_BYTES` | `handshake_max_bytes` | `1 MiB` | cap on one handshake frame |
//! | `PAGEWIRE_HANDSHAKE_TIMEOUT_MS` | `handshake_timeout` | `5000` | connect + handshake deadline |
//! | `PAGEWIRE_BATCH_TIMEOUT_MS` | `batch_timeout` | `30000` | default batch deadline |
//! | `PAGEWIRE_IO_TIMEOUT_MS` | `io_timeout` | `10000` | TCP data-stream read/write timeout |
//! | `PAGEWIRE_PROGRESS` | `progress` | `auto` | verbs: `auto` (a completion thread reaps whatever callers leave) or `manual` (only callers reap: waits, `Engine::reap`) |
//! | `PAGEWIRE_NOTIFY_QUEUE` | `notify_queue` | `65536` | most notifications queued for the application (1..=16M); at the bound a notification is dropped, counted, and its peer's connection broken |
//! | `PAGEWIRE_MAX_PEERS` | `max_peers` | `1024` | most established peers (1..=65536); at the cap a `connect` fails with `Error::TooManyPeers` and an incoming handshake is refused (the initiator gets `HandshakeError::TooManyPeers`) until a peer is disconnected or its connection breaks |
//! | `PAGEWIRE_POLL_SPIN_US` | `poll_spin` | `5000` | verbs: completion thread keeps polling this long after the last post or completion; a waiting caller busy-polls this long without a completion before it blocks (0..=10 s) |
//!
//! Sizes accept a plain byte count or a `K`/`M`/`G` suffix (powers of 1024).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
pub use crate::types::{BackendKind, ProgressMode};
use crate::util;

mod priority;
pub use priority::{MemoryKey, RailPriority};

// The kinds are vocabulary (`types`); parsing them is configuration, so the impls that
// report a config error live here.

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendKind::Auto),
            "verbs" | "rdma" | "ib" => Ok(BackendKind::Verbs),
            "tcp" => Ok(BackendKind::Tcp),
            "loopback" | "local" | "memcpy" => Ok(BackendKind::Loopback),
            _ => Err(Error::config(
                "backend",
                s,
                "expected auto, verbs, tcp or loopback",
            )),
        }
    }
}

impl FromStr for ProgressMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ProgressMode::Auto),
            "manual" => Ok(ProgressMode::Manual),
            _ => Err(Error::config("progress", s, "expected auto or manual")),
        }
    }
}

/// All engine settings. Build with [`EngineConfig::builder`]; every field is validated
/// by [`EngineConfigBuilder::build`].
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Data path.
    pub backend: BackendKind,
    /// Control listener address.
    pub listen: SocketAddr,
    /// Shared secret; when set, peers must present the same bytes.
    pub token: Option<String>,
    /// Verbs device name; `None` picks the first usable one.
    pub rdma_device: Option<String>,
    /// Several rails: which serve which memory, by hand; `None` derives it from the
    /// PCIe and NUMA topology.
    pub rail_priority: Option<RailPriority>,
    /// Root of the sysfs tree the rail choice reads; `None` is `/sys`.
    pub sysfs_root: Option<PathBuf>,
    /// Verbs port number (1-based).
    pub ib_port: u8,
    /// GID index; `None` auto-selects.
    pub gid_index: Option<u32>,
    /// Path MTU cap in bytes; `None` uses the port's active MTU.
    pub mtu: Option<u32>,
    /// RC QPs per peer.
    pub qps_per_peer: u16,
    /// Send queue depth per QP.
    pub tx_depth: u32,
    /// One WR in this many is signalled.
    pub signal_every: u32,
    /// Largest single WR (verbs) or chunk (TCP); larger ops are sliced.
    pub max_wr_bytes: u64,
    /// Registrations larger than this are split into several MRs; `None` = device max.
    pub max_mr_bytes: Option<u64>,
    /// TCP data streams per peer.
    pub tcp_streams: u16,
    /// Cap on one handshake frame.
    pub handshake_max_bytes: u32,
    /// Deadline for connect + handshake, and per-frame read timeout on the listener.
    pub handshake_timeout: Duration,
    /// Deadline a batch gets when it sets none.
    pub batch_timeout: Duration,
    /// TCP data-stream socket read/write timeout (detects half-open peers).
    pub io_timeout: Duration,
    /// Verbs: how long the completion thread keeps polling (spinning with yields) after
    /// the last post or completion before it backs off to sleeps (while WRs are
    /// outstanding it always polls); also how long a caller in `wait` or
    /// `poll_notification` busy-polls without any completion before it blocks.
    pub poll_spin: Duration,
    /// Verbs: a completion thread, or only callers, reap completions.
    pub progress: ProgressMode,
    /// Most notifications queued for the application. A notification that arrives while
    /// this many are queued is dropped, counted ([`crate::Engine::notifications_dropped`])
    /// and its peer's connection is broken, so no peer grows the queue without bound.
    pub notify_queue: usize,
    /// Most established peers (each holds sockets, memory, maybe threads). A connection
    /// past it is refused on both sides, so no client exhausts the process's
    /// descriptors. Only working connections count: a peer's slot is free again once it
    /// is disconnected or its connection broke.
    pub max_peers: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            listen: SocketAddr::from(([0, 0, 0, 0], 0)),
            token: None,
            rdma_device: None,
            rail_priority: None,
            sysfs_root: None,
            ib_port: 1,
            gid_index: None,
            mtu: None,
            qps_per_peer: 2,
            tx_depth: 256,
            signal_every: 16,
            max_wr_bytes: 1 << 20,
            max_mr_bytes: None,
            tcp_streams: 4,
            handshake_max_bytes: 1 << 20,
            handshake_timeout: Duration::from_secs(5),
            batch_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(10),
            poll_spin: Duration::from_millis(5),
            progress: ProgressMode::Auto,
            notify_queue: 1 << 16,
            max_peers: 1024,
        }
    }
}

impl EngineConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> EngineConfigBuilder {
        EngineConfigBuilder {
            cfg: EngineConfig::default(),
        }
    }

    /// Defaults plus the environment overrides.
    pub fn from_env() -> Result<Self> {
        Self::builder().with_env()?.build()
    }

    fn validate(&self) -> Result<()> {
        let range = |key: &str, v: u64, lo: u64, hi: u64| -> Result<()> {
            if v < lo || v > hi {
                return Err(Error::config(key, v, format!("expected {lo}..={hi}")));
            }
            Ok(())
        };
        range("ib_port", self.ib_port.into(), 1, 255)?;
        range("qps_per_peer", self.qps_per_peer.into(), 1, 64)?;
        range("tx_depth", self.tx_depth.into(), 1, 1 << 16)?;
        range(
            "signal_every",
            self.signal_every.into(),
            1,
            self.tx_depth.into(),
        )?;
        range("max_wr_bytes", self.max_wr_bytes, 1, 1 << 31)?;
        if let Some(m) = self.max_mr_bytes {
            range("max_mr_bytes", m, 4096, u64::MAX)?;
        }
        range("tcp_streams", self.tcp_streams.into(), 1, 64)?;
        range("notify_queue", self.notify_queue as u64, 1, 1 << 24)?;
        range("max_peers", self.max_peers as u64, 1, 1 << 16)?;
        if self.poll_spin > Duration::from_secs(10) {
            return Err(Error::config(
                "poll_spin",
                format!("{:?}", self.poll_spin),
                "expected at most 10 s",
            ));
        }
        range(
            "handshake_max_bytes",
            self.handshake_max_bytes.into(),
            4096,
            128 << 20,
        )?;
        if let Some(mtu) = self.mtu
            && ![256, 512, 1024, 2048, 4096].contains(&mtu)
        {
            return Err(Error::config(
                "mtu",
                mtu,
                "expected 256..4096, a power of two",
            ));
        }
        if let Some(t) = &self.token {
            range("token length", t.len() as u64, 1, 256)?;
        }
        for (key, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("batch_timeout", self.batch_timeout),
            ("io_timeout", self.io_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::config(key, format!("{d:?}"), "must be > 0"));
            }
        }
        Ok(())
    }
}

/// Builder for [`EngineConfig`].
#[derive(Debug, Clone)]
#[must_use]
pub struct EngineConfigBuilder {
    cfg: EngineConfig,
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.cfg.$name = v;
            self
        }
    };
}

impl EngineConfigBuilder {
    setter!(/// Data path.
        backend: BackendKind);
    setter!(/// Control listener address (`127.0.0.1:0` for tests).
        listen: SocketAddr);
    setter!(/// Verbs port number.
        ib_port: u8);
    setter!(/// RC QPs per peer.
        qps_per_peer: u16);
    setter!(/// Send queue depth per QP.
        tx_depth: u32);
    setter!(/// Signal one WR in N.
        signal_every: u32);
    setter!(/// Slice size.
        max_wr_bytes: u64);
    setter!(/// TCP data streams per peer.
        tcp_streams: u16);
    setter!(/// Cap on one handshake frame.
        handshake_max_bytes: u32);
    setter!(/// Connect + handshake deadline.
        handshake_timeout: Duration);
    setter!(/// Default batch deadline.
        batch_timeout: Duration);
    setter!(/// TCP data-stream socket timeout.
        io_timeout: Duration);
    setter!(/// Verbs: completion-thread polling grace period after the last activity.
        poll_spin: Duration);
    setter!(/// Verbs: completion thread (`Auto`) or caller-driven (`Manual`) progress.
        progress: ProgressMode);
    setter!(/// Most notifications queued for the application.
        notify_queue: usize);
    setter!(/// Most established peers.
        max_peers: usize);

    /// Shared secret.
    pub fn token(mut self, t: impl Into<String>) -> Self {
        self.cfg.token = Some(t.into());
        self
    }
    /// Verbs device name.
    pub fn rdma_device(mut self, d: impl Into<String>) -> Self {
        self.cfg.rdma_device = Some(d.into());
        self
    }
    /// Which rails serve which memory (see [`RailPriority`] for the syntax).
    pub fn rail_priority(mut self, p: RailPriority) -> Self {
        self.cfg.rail_priority = Some(p);
        self
    }
    /// Root of the sysfs tree the rail choice reads.
    pub fn sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.cfg.sysfs_root = Some(root.into());
        self
    }
    /// GID index.
    pub fn gid_index(mut self, i: u32) -> Self {
        self.cfg.gid_index = Some(i);
        self
    }
    /// Path MTU cap.
    pub fn mtu(mut self, m: u32) -> Self {
        self.cfg.mtu = Some(m);
        self
    }
    /// Split registrations above this many bytes.
    pub fn max_mr_bytes(mut self, m: u64) -> Self {
        self.cfg.max_mr_bytes = Some(m);
        self
    }

    /// Applies the `PAGEWIRE_*` environment variables (see the module docs).
    pub fn with_env(self) -> Result<Self> {
        self.with_vars(|k| std::env::var(k).ok())
    }

    /// Applies overrides from any key lookup (the environment in production, a map in tests).
    pub fn with_vars(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let c = &mut self.cfg;
        if let Some(v) = get("PAGEWIRE_TRANSPORT") {
            c.backend = v.parse().map_err(|_| {
                Error::config("PAGEWIRE_TRANSPORT", &v, "expected auto|verbs|tcp|loopback")
            })?;
        }
        if let Some(v) = get("PAGEWIRE_LISTEN") {
            c.listen = v
                .parse()
                .map_err(|_| Error::config("PAGEWIRE_LISTEN", &v, "expected ip:port"))?;
        }
        if let Some(v) = get("PAGEWIRE_TOKEN") {
            c.token = Some(v);
        }
        if let Some(v) = get("PAGEWIRE_RDMA_DEVICE") {
            c.rdma_device = Some(v);
        }
        if let Some(v) = get("PAGEWIRE_RAIL_PRIORITY") {
            c.rail_priority = Some(v.parse().map_err(|e| match e {
                Error::Config { reason, .. } => Error::config("PAGEWIRE_RAIL_PRIORITY", &v, reason),
                e => e,
            })?);
        }
        if let Some(v) = get("PAGEWIRE_SYSFS_ROOT") {
            c.sysfs_root = Some(PathBuf::from(v));
        }
        if let Some(v) = get("PAGEWIRE_IB_PORT") {
            c.ib_port = parse_num("PAGEWIRE_IB_PORT", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_GID_INDEX") {
            c.gid_index = Some(parse_num("PAGEWIRE_GID_INDEX", &v)?);
        }
        if let Some(v) = get("PAGEWIRE_MTU") {
            c.mtu = Some(parse_num("PAGEWIRE_MTU", &v)?);
        }
        if let Some(v) = get("PAGEWIRE_QPS_PER_PEER") {
            c.qps_per_peer = parse_num("PAGEWIRE_QPS_PER_PEER", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_TX_DEPTH") {
            c.tx_depth = parse_num("PAGEWIRE_TX_DEPTH", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_SIGNAL_EVERY") {
            c.signal_every = parse_num("PAGEWIRE_SIGNAL_EVERY", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_MAX_WR_BYTES") {
            c.max_wr_bytes = parse_size("PAGEWIRE_MAX_WR_BYTES", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_MAX_MR_BYTES") {
            c.max_mr_bytes = Some(parse_size("PAGEWIRE_MAX_MR_BYTES", &v)?);
        }
        if let Some(v) = get("PAGEWIRE_TCP_STREAMS") {
            c.tcp_streams = parse_num("PAGEWIRE_TCP_STREAMS", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_HANDSHAKE_MAX_BYTES") {
            let n = parse_size("PAGEWIRE_HANDSHAKE_MAX_BYTES", &v)?;
            c.handshake_max_bytes = u32::try_from(n)
                .map_err(|_| Error::config("PAGEWIRE_HANDSHAKE_MAX_BYTES", &v, "too large"))?;
        }
        for (key, field) in [
            ("PAGEWIRE_HANDSHAKE_TIMEOUT_MS", &mut c.handshake_timeout),
            ("PAGEWIRE_BATCH_TIMEOUT_MS", &mut c.batch_timeout),
            ("PAGEWIRE_IO_TIMEOUT_MS", &mut c.io_timeout),
        ] {
            if let Some(v) = get(key) {
                *field = Duration::from_millis(parse_num(key, &v)?);
            }
        }
        if let Some(v) = get("PAGEWIRE_NOTIFY_QUEUE") {
            c.notify_queue = parse_num("PAGEWIRE_NOTIFY_QUEUE", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_MAX_PEERS") {
            c.max_peers = parse_num("PAGEWIRE_MAX_PEERS", &v)?;
        }
        if let Some(v) = get("PAGEWIRE_POLL_SPIN_US") {
            c.poll_spin = Duration::from_micros(parse_num("PAGEWIRE_POLL_SPIN_US", &v)?);
        }
        if let Some(v) = get("PAGEWIRE_PROGRESS") {
            c.progress = v
                .parse()
                .map_err(|_| Error::config("PAGEWIRE_PROGRESS", &v, "expected auto|manual"))?;
        }
        Ok(self)
    }

    /// Validates and returns the config.
    pub fn build(self) -> Result<EngineConfig> {
        self.cfg.validate()?;
        Ok(self.cfg)
    }
}

fn parse_num<T: FromStr>(key: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::config(key, v, "expected an unsigned integer in range"))
}

/// [`util::parse_size`] as a config error naming `key`.
pub(crate) fn parse_size(key: &str, v: &str) -> Result<u64> {
    util::parse_size(v).map_err(|reason| Error::config(key, v, reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn env_overrides_apply_and_validate() {
        let vars: HashMap<&str, &str> = [
            ("PAGEWIRE_TRANSPORT", "tcp"),
            ("PAGEWIRE_LISTEN", "127.0.0.1:7000"),
            ("PAGEWIRE_TCP_STREAMS", "8"),
            ("PAGEWIRE_MAX_WR_BYTES", "256K"),
            ("PAGEWIRE_BATCH_TIMEOUT_MS", "1500"),
            ("PAGEWIRE_POLL_SPIN_US", "250"),
            ("PAGEWIRE_PROGRESS", "Manual"),
            ("PAGEWIRE_NOTIFY_QUEUE", "1024"),
            ("PAGEWIRE_MAX_PEERS", "2"),
        ]
        .into_iter()
        .collect();
        let cfg = EngineConfig::builder()
            .with_vars(|k| vars.get(k).map(|s| s.to_string()))
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(cfg.backend, BackendKind::Tcp);
        assert_eq!(cfg.listen.port(), 7000);
        assert_eq!(cfg.tcp_streams, 8);
        assert_eq!(cfg.max_wr_bytes, 256 << 10);
        assert_eq!(cfg.batch_timeout, Duration::from_millis(1500));
        assert_eq!(cfg.poll_spin, Duration::from_micros(250));
        assert_eq!(cfg.progress, ProgressMode::Manual);
        assert_eq!(cfg.notify_queue, 1024);
        assert_eq!(cfg.max_peers, 2);
        assert_eq!(EngineConfig::default().max_peers, 1024);
        let err = EngineConfig::builder().max_peers(0).build().unwrap_err();
        assert!(err.to_string().contains("max_peers"), "{err}");
        assert!(
            EngineConfig::builder()
                .notify_queue(0)
                .build()
                .unwrap_err()
                .to_string()
                .contains("notify_queue")
        );
        assert_eq!(EngineConfig::default().progress, ProgressMode::Auto);
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = EngineConfig::builder()
            .with_vars(|k| (k == "PAGEWIRE_TRANSPORT").then(|| "carrier-pigeon".into()))
            .unwrap_err();
        assert!(err.to_string().contains("PAGEWIRE_TRANSPORT"), "{err}");
        let err = EngineConfig::builder()
            .with_vars(|k| (k == "PAGEWIRE_PROGRESS").then(|| "sometimes".into()))
            .unwrap_err();
        assert!(err.to_string().contains("PAGEWIRE_PROGRESS"), "{err}");
        let err = EngineConfig::builder()
            .with_vars(|k| (k == "PAGEWIRE_RAIL_PRIORITY").then(|| "cpu:0=a;cpu:0=b".into()))
            .unwrap_err();
        assert!(
            matches!(&err, Error::Config { key, .. } if key == "PAGEWIRE_RAIL_PRIORITY"),
            "{err}"
        );
        let cfg = EngineConfig::builder()
            .with_vars(|k| match k {
                "PAGEWIRE_RAIL_PRIORITY" => Some("cpu:1=rxe1/rxe0".into()),
                "PAGEWIRE_SYSFS_ROOT" => Some("/tmp/fake-sys".into()),
                _ => None,
            })
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(
            cfg.rail_priority.unwrap().get(&MemoryKey::Cpu(1)).unwrap(),
            [vec!["rxe1".to_string()], vec!["rxe0".to_string()]]
        );
        assert_eq!(cfg.sysfs_root.unwrap(), PathBuf::from("/tmp/fake-sys"));
        let err = EngineConfig::builder().qps_per_peer(0).build().unwrap_err();
        assert!(err.to_string().contains("qps_per_peer"), "{err}");
        let err = EngineConfig::builder().mtu(1500).build().unwrap_err();
        assert!(err.to_string().contains("mtu"), "{err}");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("k", "4096").unwrap(), 4096);
        assert_eq!(parse_size("k", "64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("k", "2G").unwrap(), 2 << 30);
        assert!(parse_size("k", "12Q").is_err());
        assert!(parse_size("k", "99999999999999G").is_err());
    }
}
