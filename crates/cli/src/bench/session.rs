//! What every benchmark does around the measurement: open the engine, meet the peer on
//! the side channel, connect the engines, and describe both ends for the header.
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use pagewire_transport::{
    Access, BackendKind, EndpointInfo, Engine, EngineConfig, HostBuffer, PeerId, ProgressMode,
    RemoteRegion,
};

use super::args::{ProgressArg, TransportArg};
use super::oob::{Channel, Msg, OobError, VERSION, Welcome};
use super::report::{EndpointDesc, Header};

/// How long the server waits for a connected client's hello before dropping it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Engine settings a benchmark controls.
#[derive(Debug, Clone)]
pub struct EngineOpts {
    pub transport: TransportArg,
    pub lanes: u32,
    pub device: Option<String>,
    pub gid_index: Option<u32>,
    pub ib_port: Option<u8>,
    pub tx_depth: u32,
    /// `None`: the engine's (environment or default).
    pub progress: Option<ProgressArg>,
}

pub fn backend_kind(t: TransportArg) -> BackendKind {
    match t {
        TransportArg::Auto => BackendKind::Auto,
        TransportArg::Verbs => BackendKind::Verbs,
        TransportArg::Tcp => BackendKind::Tcp,
        TransportArg::Loopback => BackendKind::Loopback,
    }
}

/// Opens an engine whose control listener binds `listen`. `PAGEWIRE_*` environment
/// variables apply first; the flags given on the command line win.
pub fn open_engine(o: &EngineOpts, listen: SocketAddr) -> anyhow::Result<Engine> {
    let lanes = u16::try_from(o.lanes).context("too many QPs")?;
    let mut b = EngineConfig::builder()
        .with_env()
        .context("PAGEWIRE_* environment")?
        .backend(backend_kind(o.transport))
        .listen(listen)
        .qps_per_peer(lanes)
        .tcp_streams(lanes);
    let base = b.clone().build().context("engine configuration")?;
    if o.tx_depth > base.tx_depth {
        b = b.tx_depth(o.tx_depth);
    }
    if let Some(d) = &o.device {
        b = b.rdma_device(d.clone());
    }
    if let Some(g) = o.gid_index {
        b = b.gid_index(g);
    }
    if let Some(p) = o.ib_port {
        b = b.ib_port(p);
    }
    if let Some(p) = o.progress {
        b = b.progress(match p {
            ProgressArg::Auto => ProgressMode::Auto,
            ProgressArg::Manual => ProgressMode::Manual,
        });
    }
    let cfg = b.build().context("engine configuration")?;
    let what = match (o.transport, &o.device) {
        (_, Some(d)) => format!("opening RDMA device {d}"),
        (TransportArg::Verbs, None) => "opening the verbs transport".to_string(),
        (t, None) => format!("opening the {} transport", t.name()),
    };
    let engine = Engine::new(cfg).context(what)?;
    if o.transport == TransportArg::Auto && engine.backend_kind() != BackendKind::Verbs {
        // `auto` may fall back; it says so, once per process.
        static SAID: std::sync::Once = std::sync::Once::new();
        let why = engine.backend_info().selection;
        SAID.call_once(|| eprintln!(" pagewire: transport {why}"));
    }
    Ok(engine)
}

/// The transport an engine runs, for the server's waiting line: `verbs (rxe0)`, `tcp`.
pub fn describe(engine: &Engine) -> String {
    let info = engine.backend_info();
    match info.kind {
        BackendKind::Verbs => format!("verbs ({} port {})", info.device, info.port),
        k => k.to_string(),
    }
}

/// Bytes of memory this machine has available (`MemAvailable`), if it says.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses a run whose buffers (`bytes` in this process, all ends together) would not
/// fit in the memory this machine has available, before allocating any of it.
pub fn check_memory(bytes: u64, what: &str, smaller: &str) -> anyhow::Result<()> {
    if let Some(avail) = mem_available()
        && bytes > avail / 10 * 9
    {
        bail!(
            "{what} needs {} MiB in this process, more than the {} MiB this machine has \
             available; {smaller}",
            bytes >> 20,
            avail >> 20
        );
    }
    Ok(())
}

/// A registered buffer of one end.
#[derive(Debug)]
pub struct Local {
    pub buf: HostBuffer,
}

impl Local {
    pub fn new(engine: &Engine, len: u64) -> anyhow::Result<Local> {
        let len = usize::try_from(len).context("buffer too large")?;
        let buf = HostBuffer::new(len).with_context(|| format!("allocating {len} B"))?;
        engine
            .register(&buf, Access::ALL)
            .with_context(|| format!("registering {len} B"))?;
        Ok(Local { buf })
    }

    pub fn base(&self) -> u64 {
        self.buf.addr()
    }
}

/// The peer's exposed buffer: the region that covers at least `len` bytes.
pub fn remote_buffer(engine: &Engine, peer: PeerId, len: u64) -> anyhow::Result<RemoteRegion> {
    let regions = engine.peer_regions(peer).context("peer regions")?;
    // A buffer bigger than the MR limit arrives as consecutive chunks: merge them.
    let mut best: Option<(u64, u64, RemoteRegion)> = None;
    let mut sorted = regions.clone();
    sorted.sort_by_key(|r| r.addr);
    for r in &sorted {
        match &mut best {
            Some((start, end, _)) if *end == r.addr && *end - *start < len => *end = r.end(),
            _ => {
                if best.as_ref().is_none_or(|(s, e, _)| e - s < len) {
                    best = Some((r.addr, r.end(), *r));
                }
            }
        }
    }
    match best {
        Some((start, end, first)) if end - start >= len => Ok(RemoteRegion::new(
            start,
            end - start,
            first.rkey,
            first.access,
        )),
        _ => bail!(
            "the peer exposes no buffer of {len} B (it exposes {} regions)",
            regions.len()
        ),
    }
}

/// Resolves `host`, `host:port`, `ip`, `ip:port` or `[v6]:port`, with a default port.
pub fn server_target(addr: &str, default_port: u16) -> anyhow::Result<SocketAddr> {
    if let Ok(sa) = addr.parse::<SocketAddr>() {
        return Ok(sa);
    }
    if let Ok(ip) = addr.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    let resolved = match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => {
            let port: u16 = port
                .parse()
                .with_context(|| format!("bad port in {addr:?}"))?;
            (host, port).to_socket_addrs()
        }
        _ => (addr, default_port).to_socket_addrs(),
    };
    resolved
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("{addr} resolves to no address"))
}

/// The client's side of the meeting: connect, say hello, get the welcome. A refusal
/// comes back as an error with the server's reason.
pub fn client_hello(
    server: SocketAddr,
    test: &str,
    params: serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<(Channel, Welcome)> {
    let deadline = Instant::now() + timeout;
    // The server may not be listening yet (scripts start both at once): retry until the deadline.
    let stream = loop {
        match TcpStream::connect_timeout(&server, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("side channel {server}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("connecting to the bench server at {server}"));
            }
        }
    };
    let mut ch = Channel::new(stream, timeout)?;
    ch.send(&Msg::Hello {
        version: VERSION,
        test: test.into(),
        params,
    })?;
    let w = match ch.expect_welcome() {
        Ok(w) => w,
        Err(OobError::Refused(reason)) => {
            bail!("the server at {server} refused this client: {reason}")
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("waiting for the welcome of the server at {server}"));
        }
    };
    Ok((ch, w))
}

/// The server's side: accept connections until one says a valid hello with parameters
/// equal to ours. Malformed or foreign connections and mismatched parameters are
/// logged and dropped; the server keeps waiting. A `quiet` server (the in-process one of
/// `--local`) takes exactly one connection and fails if it is not the client.
pub fn server_accept(
    listener: &TcpListener,
    test: &str,
    mine: &serde_json::Value,
    timeout: Duration,
    quiet: bool,
) -> anyhow::Result<Channel> {
    loop {
        let (stream, from) = listener.accept().context("side channel accept")?;
        let mut ch = match Channel::new(stream, HELLO_TIMEOUT) {
            Ok(c) => c,
            Err(e) if quiet => return Err(e).context("the in-process client's connection"),
            Err(e) => {
                eprintln!(" pagewire: dropped connection from {from}: {e}");
                continue;
            }
        };
        let mut refused: Option<String> = None;
        let mut refuse = |ch: &mut Channel, reason: String| {
            if !quiet {
                eprintln!(" pagewire: refused client {from}: {reason}; waiting for another");
            }
            let _ = ch.send(&Msg::Refuse {
                reason: reason.clone(),
            });
            refused = Some(reason);
        };
        match ch.recv() {
            Ok(Msg::Hello {
                version,
                test: t,
                params,
            }) => {
                if version != VERSION {
                    refuse(
                        &mut ch,
                        format!("side-channel version {version}, this server speaks {VERSION}"),
                    );
                } else if t != test {
                    refuse(
                        &mut ch,
                        format!("client runs `{t}`, this server runs `{test}`"),
                    );
                } else if &params != mine {
                    refuse(&mut ch, diff(mine, &params));
                } else {
                    ch.set_timeout(timeout)?;
                    if !quiet {
                        eprintln!(" pagewire: client {from} connected");
                    }
                    return Ok(ch);
                }
            }
            Ok(other) => refuse(&mut ch, format!("expected a hello, got {other:?}")),
            Err(e) if quiet => return Err(e).context("the in-process client's hello"),
            Err(e @ (OobError::BadMagic(_) | OobError::TooLarge(_) | OobError::BadMessage(_))) => {
                eprintln!(" pagewire: ignoring foreign or malformed connection from {from}: {e}");
            }
            Err(e) => eprintln!(" pagewire: dropped connection from {from}: {e}"),
        }
        if let Some(reason) = refused
            && quiet
        {
            bail!("refused the in-process client: {reason}");
        }
    }
}

/// Unblocks an in-process server still waiting in `server_accept` (its client failed
/// before connecting): a connection that says nothing ends its wait with an error.
pub fn wake_local_server(addr: SocketAddr) {
    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
}

/// Why a client's parameters are refused: the transports (each end's resolved backend)
/// first, then every other key that differs.
pub(super) fn diff(mine: &serde_json::Value, theirs: &serde_json::Value) -> String {
    let (Some(a), Some(b)) = (mine.as_object(), theirs.as_object()) else {
        return "parameters are not an object".into();
    };
    if let (Some(s), Some(c)) = (a.get("transport"), b.get("transport"))
        && s != c
    {
        let name = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_string();
        return format!(
            "wrong transport: the server runs {}, the client {} (give both ends the same \
             --transport, or -d on both)",
            name(s),
            name(c)
        );
    }
    let mut out = Vec::new();
    for (k, v) in a {
        match b.get(k) {
            Some(w) if w == v => {}
            Some(w) => out.push(format!("{k}: server {v}, client {w}")),
            None => out.push(format!("{k}: missing")),
        }
    }
    for k in b.keys().filter(|k| !a.contains_key(*k)) {
        out.push(format!("{k}: unknown"));
    }
    format!(
        "parameters differ (give both ends the same flags): {}",
        out.join("; ")
    )
}

/// Connects the client engine to the server engine (same host as the side channel).
pub fn connect_engine(engine: &Engine, server: SocketAddr, w: &Welcome) -> anyhow::Result<PeerId> {
    let addr = SocketAddr::new(server.ip(), w.engine_port);
    engine
        .connect(addr)
        .with_context(|| format!("engine handshake with {addr}"))
}

pub fn accept_engine(engine: &Engine, timeout: Duration) -> anyhow::Result<PeerId> {
    engine
        .accept(Instant::now() + timeout)
        .ok_or_else(|| anyhow!("the client's engine did not connect within {timeout:?}"))
}

fn endpoint_desc(ep: &EndpointInfo, region: Option<(u32, u64)>, fallback: &str) -> EndpointDesc {
    let mut d = EndpointDesc::default();
    match ep {
        EndpointInfo::Verbs { gid, lid, qps, .. } => {
            d.qps = qps.iter().map(|q| (q.qpn, q.psn)).collect();
            d.lid = Some(*lid);
            d.gid = Some(*gid);
            if let Some((rkey, va)) = region {
                d.rkey = Some(rkey);
                d.vaddr = Some(va);
            }
        }
        EndpointInfo::Tcp {
            data_port, streams, ..
        } => {
            d.socket = Some(format!(
                "{fallback} data port {data_port}, {streams} stream(s)"
            ));
        }
        EndpointInfo::Loopback { engine_id, conn } => {
            d.socket = Some(format!("in-process engine {engine_id:#x} conn {conn}"));
        }
        _ => d.socket = Some(fallback.to_string()),
    }
    d
}

/// The header block for one connected pair.
#[allow(clippy::too_many_arguments)]
pub fn header(
    engine: &Engine,
    peer: PeerId,
    title: String,
    tx_depth: u32,
    cq_mod: u32,
    local: &Local,
    remote: &RemoteRegion,
    data_exchange: &str,
) -> anyhow::Result<Header> {
    let info = engine.backend_info();
    let pi = engine.peer_info(peer)?;
    let local_rkey = engine
        .exposed_regions()
        .iter()
        .find(|r| r.addr <= local.base() && local.base() < r.end())
        .map(|r| r.rkey);
    let kind = info.kind;
    Ok(Header {
        title,
        device: info.device.clone(),
        rails: info.rails.clone(),
        transport: kind.to_string(),
        link_type: info.link.clone(),
        connection: match kind {
            BackendKind::Verbs => "RC".into(),
            BackendKind::Tcp => "TCP".into(),
            _ => "memcpy".into(),
        },
        qps: u32::from(info.qps_or_streams),
        tx_depth,
        cq_mod,
        mtu: (info.mtu > 0).then_some(info.mtu),
        gid_index: info.gid_index,
        progress: (kind == BackendKind::Verbs).then(|| engine.config().progress.to_string()),
        outstanding_reads: None,
        buffer_bytes: None,
        data_exchange: data_exchange.into(),
        local: endpoint_desc(
            &pi.local_endpoint,
            local_rkey.map(|k| (k, local.base())),
            &engine.local_addr().to_string(),
        ),
        remote: endpoint_desc(
            &pi.remote_endpoint,
            Some((remote.rkey, remote.addr)),
            &pi.control_addr.to_string(),
        ),
    })
}

/// Runs the server half in a thread on an ephemeral loopback port, for the in-process
/// mode; returns the port and the thread.
pub fn spawn_local_server<F>(
    f: F,
) -> anyhow::Result<(SocketAddr, std::thread::JoinHandle<anyhow::Result<()>>)>
where
    F: FnOnce(TcpListener) -> anyhow::Result<()> + Send + 'static,
{
    let listener =
        TcpListener::bind("127.0.0.1:0").context("binding the in-process side channel")?;
    let addr = listener.local_addr()?;
    let t = std::thread::Builder::new()
        .name("bench-server".into())
        .spawn(move || f(listener))?;
    Ok((addr, t))
}

/// Joins the in-process server, preferring the client's error (it names the cause).
pub fn join_local(
    t: std::thread::JoinHandle<anyhow::Result<()>>,
    client: anyhow::Result<()>,
) -> anyhow::Result<()> {
    let server = t
        .join()
        .map_err(|_| anyhow!("the in-process server panicked"))?;
    client?;
    server.context("in-process server")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client on another transport is told so first, in words; other differences are
    /// listed by key.
    #[test]
    fn refusals_name_the_difference() {
        let server = serde_json::json!({"iters": 20, "transport": "tcp", "qps": 1});
        let client = serde_json::json!({"iters": 30, "transport": "verbs", "qps": 1});
        let why = diff(&server, &client);
        assert!(
            why.starts_with("wrong transport: the server runs tcp, the client verbs"),
            "{why}"
        );
        let client = serde_json::json!({"iters": 30, "transport": "tcp", "qps": 1});
        let why = diff(&server, &client);
        assert!(why.contains("iters: server 20, client 30"), "{why}");
        assert!(!why.contains("qps"), "{why}");
    }
}
