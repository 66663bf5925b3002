//! `pagewire bench write|read|lat` over the transport engine.
//!
//! Each end registers one buffer of twice the largest message (rounded up to a page): the
//! lower half is what it sends (or lets the peer read), the upper half is where the
//! peer's data lands.
//! The client always initiates; with `-b` the server initiates too, at the same time,
//! and the client prints the sum of both ends' bandwidth (as perftest does).
//!
//! The op loop keeps at most `-t` operations in flight, posted in batches of `-Q`
//! (one completion per batch, like perftest's CQ moderation). Post and completion
//! times are taken around `Engine::submit` and `TransferHandle::wait`.
//!
//! `lat` is a WRITE ping-pong: the client writes `size` bytes tagged with the iteration
//! number, the server waits for that notification and writes back. The engine surfaces
//! a notification only once every byte of the batch is in memory, on every backend, so
//! each half round trip is the time for the data to arrive *and* be known to have
//! arrived (perftest instead spins on the last byte, which only verbs guarantees to
//! land last).
use std::collections::VecDeque;
use std::io::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use clap::Parser;
use pagewire_transport::{
    Batch, BatchStatus, Engine, Op, PeerId, RemoteRegion, TransferHandle, TransferOp,
};

use super::args::{PerfArgs, Role, TestKind, TransportArg};
use super::oob::{Channel, Msg, Welcome};
use super::pattern;
use super::progress::{self, Progress, Unit};
use super::report::{Printer, RunInfo};
use super::session::{self, EngineOpts, Local};
use super::stats::{self, BwResult, BwSamples, LatResult};

/// The flags both ends must agree on (perftest's symmetric flags, plus ours), and the
/// transport this end resolved (`verbs`, `tcp`): a client whose transport differs is
/// refused with a message that says so.
pub(super) fn sym_params(
    kind: TestKind,
    a: &PerfArgs,
    sizes: &[u64],
    transport: &str,
) -> serde_json::Value {
    let mut p = serde_json::json!({
        "sizes": sizes,
        "iters": a.iters(kind),
        "duration": a.duration,
        "margin": a.effective_margin(),
        "qps": a.qps,
        "tx_depth": a.tx_depth(kind),
        "cq_mod": a.cq_mod(kind),
        "bidirectional": a.bidirectional,
        "verify": a.end.verify,
        "transport": transport,
        "poll_memory": a.poll_memory,
        "submit_each": a.submit_each,
    });
    // Only when set, so that a server without the flag still takes a client that does
    // not use it.
    if a.perform_warm_up {
        p["perform_warm_up"] = true.into();
    }
    p
}

fn engine_opts(kind: TestKind, a: &PerfArgs, transport: TransportArg) -> EngineOpts {
    EngineOpts {
        transport,
        lanes: a.qps,
        device: a.end.device.clone(),
        gid_index: a.end.gid_index,
        ib_port: a.end.ib_port,
        tx_depth: a.tx_depth(kind),
        progress: Some(a.progress()),
    }
}

pub fn run(kind: TestKind, args: PerfArgs) -> anyhow::Result<()> {
    if kind == TestKind::Lat {
        ensure!(
            !args.bidirectional,
            "-b does not apply to the latency test (it is a ping-pong)"
        );
        ensure!(
            args.duration.is_none(),
            "-D is not supported by the latency test; use -n"
        );
    }
    let transport = args.end.transport(args.progress.is_some())?;
    if args.poll_memory {
        ensure!(
            transport != TransportArg::Loopback,
            "--poll-memory needs a transport whose writes land in order (verbs or tcp)"
        );
    }
    let sizes = args.sizes(kind);
    let buf = 2 * landing_offset(&sizes);
    match args.end.role() {
        Role::Client(addr) => {
            let server = session::server_target(&addr, args.end.port)?;
            session::check_memory(buf, "this run's buffer", "use a smaller -s")?;
            let end = ClientEnd::open(kind, &args, transport, &sizes, false)?;
            end.run(kind, &args, &sizes, server)
        }
        Role::Server => {
            let listener = TcpListener::bind(("0.0.0.0", args.end.port))
                .with_context(|| format!("binding the side channel on port {}", args.end.port))?;
            session::check_memory(buf, "this run's buffer", "use a smaller -s")?;
            let end = ServerEnd::open(kind, &args, transport, &sizes, false)?;
            end.serve(kind, &args, &sizes, listener)
        }
        Role::Local => in_process(kind, &args, transport, &sizes),
    }
}

/// Both ends in this process, over the engine's real transport (the side channel and
/// the engines talk through 127.0.0.1). Both engines open here first, so a transport
/// that cannot be used fails at once with its reason.
fn in_process(
    kind: TestKind,
    args: &PerfArgs,
    transport: TransportArg,
    sizes: &[u64],
) -> anyhow::Result<()> {
    session::check_memory(
        4 * landing_offset(sizes),
        "this run's two buffers",
        "use a smaller -s",
    )?;
    let server_end = ServerEnd::open(kind, args, transport, sizes, true)?;
    let client_end = ClientEnd::open(kind, args, transport, sizes, true)?;
    let (a2, s2) = (args.clone(), sizes.to_vec());
    let (addr, t) = session::spawn_local_server(move |l| server_end.serve(kind, &a2, &s2, l))?;
    let r = client_end.run(kind, args, sizes, addr);
    if r.is_err() {
        session::wake_local_server(addr);
    }
    session::join_local(t, r)
}

/// The default run's bandwidth table: a few sizes, few iterations, both ends here. 32
/// iterations keep a batch of the 8 MiB row (16 WRs, 128 MiB) well inside the per-wait
/// deadline on a slow link (soft-RoCE under emulation moves 20-50 MB/s).
pub fn run_default() -> anyhow::Result<()> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: super::args::BwArgs,
    }
    let args: PerfArgs = Wrap::try_parse_from(["write", "--local", "-n", "32", "--verify"])
        .expect("fixed argv parses")
        .a
        .into();
    let transport = args.end.transport(false)?;
    in_process(
        TestKind::Write,
        &args,
        transport,
        &[4096, 65536, 1 << 20, 8 << 20],
    )
}

/// The server before any client: its engine open, its buffer registered.
struct ServerEnd {
    engine: Engine,
    local: Local,
    half: u64,
    quiet: bool,
}

impl ServerEnd {
    fn open(
        kind: TestKind,
        args: &PerfArgs,
        transport: TransportArg,
        sizes: &[u64],
        quiet: bool,
    ) -> anyhow::Result<ServerEnd> {
        let listen: SocketAddr = if quiet { "127.0.0.1:0" } else { "0.0.0.0:0" }
            .parse()
            .expect("literal");
        let engine = session::open_engine(&engine_opts(kind, args, transport), listen)?;
        let half = landing_offset(sizes);
        let local = Local::new(&engine, 2 * half)?;
        Ok(ServerEnd {
            engine,
            local,
            half,
            quiet,
        })
    }

    /// Waits for one client, runs the test with it, and returns. A client that said a
    /// valid hello but then fails the engine handshake (or vanishes) is logged and
    /// dropped like a foreign connection; the server keeps waiting.
    fn serve(
        self,
        kind: TestKind,
        args: &PerfArgs,
        sizes: &[u64],
        listener: TcpListener,
    ) -> anyhow::Result<()> {
        let ServerEnd {
            engine,
            local,
            half,
            quiet,
        } = self;
        let timeout = Duration::from_secs_f64(args.end.timeout);
        let transport = engine.backend_kind().to_string();
        let params = sym_params(kind, args, sizes, &transport);
        if !quiet {
            eprintln!(
                " pagewire bench {}: server over {}, waiting for one client (side channel \
                 port {})",
                kind.name(),
                session::describe(&engine),
                listener.local_addr()?.port()
            );
        }
        let (ch, peer, remote) = loop {
            let mut ch = session::server_accept(&listener, kind.name(), &params, timeout, quiet)?;
            // Peers a vanished client's engine connected late: not this client.
            while engine.accept(Instant::now()).is_some() {}
            let setup = (|| {
                ch.send(&Msg::Welcome(Welcome {
                    engine_port: engine.local_addr().port(),
                    buf_len: 2 * half,
                }))?;
                let peer = session::accept_engine(&engine, timeout)?;
                let remote = session::remote_buffer(&engine, peer, 2 * half)?;
                anyhow::Ok((peer, remote))
            })();
            match setup {
                Ok((peer, remote)) => break (ch, peer, remote),
                Err(e) if !quiet => {
                    eprintln!(" pagewire: client setup failed: {e:#}; waiting for another client");
                }
                Err(e) => return Err(e),
            }
        };
        let mut end = End {
            engine,
            peer,
            local,
            remote,
            ch,
            client: false,
            print: !quiet,
            half,
            timeout,
        };
        let r = end.run_all(kind, args, sizes);
        end.engine.shutdown();
        r
    }
}

/// Where the landing half of each buffer starts: past the largest message, on a page of
/// its own, as perftest keeps its send and receive buffers apart. A small ping then never
/// lands on the cache line (or the page) the receiver itself writes its own ping into.
fn landing_offset(sizes: &[u64]) -> u64 {
    sizes
        .iter()
        .max()
        .expect("at least one size")
        .next_multiple_of(4096)
}

/// The client before it meets the server: its engine open, its buffer registered (so a
/// transport that cannot be used fails here, with its reason, before any connection).
struct ClientEnd {
    engine: Engine,
    local: Local,
    half: u64,
}

impl ClientEnd {
    fn open(
        kind: TestKind,
        args: &PerfArgs,
        transport: TransportArg,
        sizes: &[u64],
        in_process: bool,
    ) -> anyhow::Result<ClientEnd> {
        let listen: SocketAddr = if in_process {
            "127.0.0.1:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .expect("literal");
        let engine = session::open_engine(&engine_opts(kind, args, transport), listen)?;
        let half = landing_offset(sizes);
        let local = Local::new(&engine, 2 * half)?;
        Ok(ClientEnd {
            engine,
            local,
            half,
        })
    }

    fn run(
        self,
        kind: TestKind,
        args: &PerfArgs,
        sizes: &[u64],
        server: SocketAddr,
    ) -> anyhow::Result<()> {
        let ClientEnd {
            engine,
            local,
            half,
        } = self;
        let timeout = Duration::from_secs_f64(args.end.timeout);
        let params = sym_params(kind, args, sizes, &engine.backend_kind().to_string());
        let (ch, w) = session::client_hello(server, kind.name(), params, timeout)?;
        ensure!(
            w.buf_len >= 2 * half,
            "the server's buffer ({} B) is smaller than this run needs",
            w.buf_len
        );
        let peer = session::connect_engine(&engine, server, &w)?;
        let remote = session::remote_buffer(&engine, peer, 2 * half)?;
        let mut end = End {
            engine,
            peer,
            local,
            remote,
            ch,
            client: true,
            print: true,
            half,
            timeout,
        };
        let r = end.run_all(kind, args, sizes);
        end.engine.shutdown();
        r
    }
}

/// One end of a connected pair.
struct End {
    engine: Engine,
    peer: PeerId,
    local: Local,
    remote: RemoteRegion,
    ch: Channel,
    client: bool,
    print: bool,
    /// Offset of the landing half in both buffers.
    half: u64,
    timeout: Duration,
}

impl End {
    fn run_all(&mut self, kind: TestKind, args: &PerfArgs, sizes: &[u64]) -> anyhow::Result<()> {
        let lat = kind == TestKind::Lat;
        let title = kind.title(args.bidirectional);
        let data_ex = if self.print && !self.client {
            "Ethernet (server)"
        } else {
            "Ethernet"
        };
        let mut header = session::header(
            &self.engine,
            self.peer,
            title,
            args.tx_depth(kind),
            args.cq_mod(kind),
            &self.local,
            &self.remote,
            data_ex,
        )?;
        header.buffer_bytes = Some(2 * self.half);
        let info = self.engine.backend_info();
        // perftest's READ header shows the outstanding reads in place of the inline size.
        if kind == TestKind::Read {
            header.outstanding_reads = info.max_outstanding_reads;
        }
        let run_info = RunInfo {
            test: kind.name(),
            transport: info.kind.to_string(),
            device: info.device.clone(),
            qps: args.qps,
            tx_depth: args.tx_depth(kind),
            bidirectional: args.bidirectional,
        };
        // The quiet in-process server must not take the stdout lock the client prints under.
        let out: Box<dyn std::io::Write> = if self.print {
            Box::new(std::io::stdout())
        } else {
            Box::new(std::io::sink())
        };
        let mut printer = Printer::new(out, args.end.json, args.report_gbits, run_info);
        if self.print {
            printer.begin(&header, lat, !args.peak_enabled(kind))?;
        }
        let mut bar = self.progress_bar(kind, args, sizes);
        self.ch.barrier(0)?;
        let mut failure = None;
        // The verdict a record carries: only with --verify.
        let verified = |v: &anyhow::Result<()>| args.end.verify.then_some(v.is_ok());
        for (i, &size) in sizes.iter().enumerate() {
            let step = 1 + 4 * i as u64;
            let verdict = if lat {
                let (r, v) = self.lat_size(step, size, args, &mut bar)?;
                if self.print {
                    bar.suspend(|| printer.lat(&r, verified(&v)))?;
                }
                v
            } else {
                let (r, v) = self.bw_size(kind, step, size, args, &mut bar)?;
                if self.print {
                    bar.suspend(|| printer.bw(&r, verified(&v)))?;
                }
                v
            };
            if let Err(e) = verdict {
                failure = Some(e);
                break;
            }
        }
        bar.finish();
        if self.print {
            let rails = self.engine.rail_stats();
            if !rails.is_empty() {
                printer.rails(&rails)?;
            }
            printer.end()?;
        }
        drop(printer);
        let _ = std::io::stdout().flush();
        match failure {
            Some(e) => Err(e),
            None => {
                if args.end.verify && self.print && !args.end.json {
                    eprintln!(" pagewire: --verify: every size checked on the receiving side: OK");
                }
                Ok(())
            }
        }
    }

    /// The run's progress bar (drawn only past two seconds, on a terminal, without
    /// --json): operations this end initiates, or the clock of a timed run.
    fn progress_bar(&self, kind: TestKind, args: &PerfArgs, sizes: &[u64]) -> Progress {
        let enabled = progress::wanted(args.end.json, self.print);
        let n = sizes.len() as u64;
        match (kind, args.duration) {
            (TestKind::Lat, _) => {
                Progress::new(n * args.iters(kind), Unit::Count("pings"), enabled, 64)
            }
            (_, Some(d)) => Progress::new(n * (d * 1e3) as u64, Unit::Millis, enabled, 1),
            _ => Progress::new(
                n * args.iters(kind) * u64::from(args.qps),
                Unit::Count("ops"),
                enabled,
                1,
            ),
        }
    }

    fn lower(&self) -> u64 {
        self.local.base()
    }

    /// One bandwidth size: fill, barrier, measure, barrier, verify, exchange results.
    /// Returns the row to print and the verification verdict.
    fn bw_size(
        &mut self,
        kind: TestKind,
        step: u64,
        size: u64,
        a: &PerfArgs,
        bar: &mut Progress,
    ) -> anyhow::Result<(BwResult, anyhow::Result<()>)> {
        let bidir = a.bidirectional;
        let initiates = self.client || bidir;
        let peer_initiates = !self.client || bidir;
        let (src_here, land_here) = match kind {
            TestKind::Read => (peer_initiates, initiates),
            _ => (initiates, peer_initiates),
        };
        // Data that starts in the client's memory uses direction 0, the server's 1.
        let (mine, theirs) = if self.client { (0, 1) } else { (1, 0) };
        let src_seed = pattern::seed_for(kind.name(), size, mine);
        let land_seed = pattern::seed_for(kind.name(), size, theirs);
        let (half, n) = (self.half as usize, size as usize);
        // Always, not only with --verify: it also faults every page in before the clock starts.
        if src_here {
            pattern::fill_buf(&mut self.local.buf, 0, n, src_seed);
        }
        if land_here {
            self.local.buf.fill_range(half..half + n, 0);
        }
        self.ch.barrier(step)?;
        let mine_result = if initiates {
            let (op, local, remote) = match kind {
                TestKind::Read => (Op::Read, self.lower() + self.half, self.remote.addr),
                _ => (Op::Write, self.lower(), self.remote.addr + self.half),
            };
            let total = a.iters(kind) * u64::from(a.qps);
            let dur = a.duration.map(Duration::from_secs_f64);
            let warm = a.warm_up_ops(kind);
            if warm > 0 {
                self.bw_loop(
                    op,
                    local,
                    remote,
                    size,
                    warm,
                    None,
                    a.tx_depth(kind),
                    a.cq_mod(kind),
                    &mut Progress::hidden(),
                )
                .context("warming up")?;
            }
            let samples = self.bw_loop(
                op,
                local,
                remote,
                size,
                total,
                dur,
                a.tx_depth(kind),
                a.cq_mod(kind),
                bar,
            )?;
            let (samples, iterations) = match a.duration {
                Some(d) => {
                    let m = a.effective_margin();
                    let w = stats::trim_window(&samples, (m * 1e9) as u64, ((d - m) * 1e9) as u64);
                    let it = w.posted.len() as u64 / u64::from(a.qps);
                    (w, it)
                }
                None => (samples, a.iters(kind)),
            };
            let cq = a.cq_mod(kind) as usize;
            Some(stats::bw_result(
                size,
                iterations,
                &samples,
                cq,
                cq,
                a.peak_enabled(kind),
            ))
        } else {
            // A passive end moves its bar by the size it waited out.
            bar.add(a.iters(kind) * u64::from(a.qps));
            None
        };
        // `timeout` bounds each of the initiator's batch waits, not its whole run; a passive
        // side that waited only `timeout` here dropped its engine under a long run (the
        // initiator then saw "peer gone"). A peer that dies still shows up at once as EOF.
        let cq = u64::from(a.cq_mod(kind).max(1));
        let waits = match a.duration {
            Some(_) => u64::from(a.tx_depth(kind)).div_ceil(cq),
            None => (a.iters(kind) * u64::from(a.qps)).div_ceil(cq),
        } + a.warm_up_ops(kind).div_ceil(cq);
        let waits = u32::try_from(waits.saturating_add(1)).unwrap_or(u32::MAX);
        let run = Duration::try_from_secs_f64(a.duration.unwrap_or(0.0))
            .unwrap_or(Duration::MAX)
            .saturating_add(self.timeout.saturating_mul(waits));
        self.ch.set_timeout(run)?;
        self.ch.barrier(step + 1)?;
        self.ch.set_timeout(self.timeout)?;
        let mut verdict: anyhow::Result<()> = Ok(());
        if a.end.verify
            && land_here
            && let Err(m) = pattern::check_buf(&self.local.buf, half, n, land_seed)
        {
            verdict = Err(anyhow!(
                "verification failed on the {} at size {size}: {m}",
                self.side()
            ));
        }
        if self.client {
            let peer_lands = match kind {
                TestKind::Read => bidir,
                _ => true,
            };
            if a.end.verify && peer_lands {
                let (ok, detail) = self.ch.recv_verified()?;
                if !ok && verdict.is_ok() {
                    verdict = Err(anyhow!(
                        "verification failed on the server at size {size}: {detail}"
                    ));
                }
            }
            let mut r = mine_result.expect("the client initiates");
            if bidir {
                let theirs = self.ch.recv_bw()?;
                r = r.sum(&theirs);
            }
            self.ch.send(&Msg::Bw { result: r })?;
            Ok((r, verdict))
        } else {
            if a.end.verify && land_here {
                let (ok, detail) = match &verdict {
                    Ok(()) => (true, String::new()),
                    Err(e) => (false, e.to_string()),
                };
                self.ch.send(&Msg::Verified { size, ok, detail })?;
            }
            if let Some(r) = mine_result {
                self.ch.send(&Msg::Bw { result: r })?;
            }
            let total = self.ch.recv_bw()?;
            Ok((total, verdict))
        }
    }

    fn side(&self) -> &'static str {
        if self.client { "client" } else { "server" }
    }

    /// Posts `total` ops (or runs for `duration`) with at most `depth` in flight, in
    /// batches of `cq_mod`, and returns each op's post and completion time.
    #[allow(clippy::too_many_arguments)]
    fn bw_loop(
        &self,
        op: Op,
        local: u64,
        remote: u64,
        size: u64,
        total: u64,
        duration: Option<Duration>,
        depth: u32,
        cq_mod: u32,
        bar: &mut Progress,
    ) -> anyhow::Result<BwSamples> {
        let start = Instant::now();
        let ns = |t: Instant| t.duration_since(start).as_nanos() as u64;
        let end_at = duration.map(|d| start + d);
        let cap = if duration.is_some() {
            1 << 16
        } else {
            total as usize
        };
        let mut s = BwSamples {
            posted: Vec::with_capacity(cap),
            completed: Vec::with_capacity(cap),
        };
        let mut inflight: VecDeque<(TransferHandle, usize)> = VecDeque::new();
        let (mut outstanding, mut posted) = (0usize, 0u64);
        let one = TransferOp {
            op,
            local,
            remote,
            len: size,
        };
        loop {
            loop {
                let remaining = match end_at {
                    Some(e) if Instant::now() >= e => 0,
                    Some(_) => u64::MAX,
                    None => total - posted,
                };
                let cnt = u64::from(cq_mod).min(remaining) as usize;
                if cnt == 0 || outstanding + cnt > depth as usize {
                    break;
                }
                let mut b = Batch::with_capacity(cnt);
                for _ in 0..cnt {
                    b.push(one);
                }
                let b = b.timeout(self.timeout);
                let t = ns(Instant::now());
                let h = self
                    .engine
                    .submit(self.peer, b)
                    .context("submitting a batch")?;
                s.posted.extend(std::iter::repeat_n(t, cnt));
                inflight.push_back((h, cnt));
                outstanding += cnt;
                posted += cnt as u64;
            }
            let Some((h, cnt)) = inflight.pop_front() else {
                break;
            };
            h.wait(Instant::now() + self.timeout)
                .with_context(|| format!("{size} B batch (op {} of the run)", s.completed.len()))?;
            let t = ns(Instant::now());
            s.completed.extend(std::iter::repeat_n(t, cnt));
            outstanding -= cnt;
            bar.add(cnt as u64);
        }
        Ok(s)
    }

    /// One latency size (ping-pong). Returns the row and the verification verdict.
    fn lat_size(
        &mut self,
        step: u64,
        size: u64,
        a: &PerfArgs,
        bar: &mut Progress,
    ) -> anyhow::Result<(LatResult, anyhow::Result<()>)> {
        let iters = a.iters(TestKind::Lat);
        let (mine, theirs) = if self.client { (0, 1) } else { (1, 0) };
        let src_seed = pattern::seed_for("lat", size, mine);
        let land_seed = pattern::seed_for("lat", size, theirs);
        let (half, n) = (self.half as usize, size as usize);
        pattern::fill_buf(&mut self.local.buf, 0, n, src_seed);
        self.local.buf.fill_range(half..half + n, 0);
        let (src, dst) = (self.lower(), self.remote.addr + self.half);
        self.ch.barrier(step)?;
        let poll = a.poll_memory;
        // --poll-memory: the last byte of each ping carries a running value 1..=255 and the
        // receiver spins on it, as ib_write_lat does; otherwise the engine's notification.
        let mark = |i: u64| (i % 255) as u8 + 1;
        // The ping is prepared once (validated, pinned, planned) and started for every
        // iteration, as ib_write_lat builds its work request once and re-posts it;
        // --submit-each submits a new batch per ping instead (the general path).
        let mut prepared = if a.submit_each {
            None
        } else {
            let mut b = Batch::new().write(src, dst, size).timeout(self.timeout);
            if !poll {
                b = b.notify(0);
            }
            Some(
                self.engine
                    .prepare(self.peer, b)
                    .context("preparing the ping")?,
            )
        };
        let start = Instant::now();
        let mut posted = Vec::with_capacity(iters as usize);
        let mut last: Option<TransferHandle> = None;
        for i in 0..iters {
            let tag = i as u32;
            if !self.client {
                self.wait_ping(poll, tag, half + n - 1, mark(i))?;
            }
            if poll {
                self.local.buf.write_at(n - 1, &[mark(i)]);
            }
            // One clock read per ping, as perftest's one cycle-counter read: the post
            // time, which also anchors the deadlines.
            let t = Instant::now();
            if let Some(p) = &mut prepared {
                let deadline = t + self.timeout;
                // One run at a time: the previous ping's completion was reaped while
                // waiting for the peer, so this returns at once.
                p.wait(deadline)
                    .with_context(|| format!("ping {}", i.saturating_sub(1)))?;
                if poll { p.start() } else { p.start_tagged(tag) }.context("starting a ping")?;
                posted.push(t.duration_since(start).as_nanos() as u64);
                // As below: the ping's own completion, as ib_write_lat polls its send CQ.
                if poll {
                    p.wait(deadline).with_context(|| format!("ping {i}"))?;
                }
            } else {
                let mut b = Batch::new()
                    .write(src, dst, size)
                    .deadline(t + self.timeout);
                if !poll {
                    b = b.notify(tag);
                }
                let h = self
                    .engine
                    .submit(self.peer, b)
                    .context("submitting a ping")?;
                posted.push(t.duration_since(start).as_nanos() as u64);
                // Right after the post and off the critical path (the peer is detecting
                // the ping meanwhile). With --poll-memory, wait for the ping's own
                // completion as ib_write_lat polls its send CQ: the waiter reaps it on
                // this thread, and the engine's completion thread stays out of the way of
                // the two spinning processes. With notifications the wait for the pong
                // reaps it anyway.
                if poll {
                    h.wait(t + self.timeout)
                        .with_context(|| format!("ping {i}"))?;
                } else if let BatchStatus::Failed(e) = h.status() {
                    bail!("ping {i} failed: {e}");
                }
                last = Some(h);
            }
            if self.client {
                self.wait_ping(poll, tag, half + n - 1, mark(i))?;
            }
            bar.add(1);
        }
        if let Some(h) = last {
            h.wait(Instant::now() + self.timeout)
                .context("the last ping")?;
        }
        if let Some(p) = &mut prepared {
            p.wait(Instant::now() + self.timeout)
                .context("the last ping")?;
        }
        if poll {
            // The last byte carried the marks; the rest must still be the pattern.
            let want = mark(iters - 1);
            let got = peek(&self.local.buf, half + n - 1);
            if a.end.verify && got != want {
                bail!("the last ping's final byte is {got:#04x}, expected {want:#04x}");
            }
            let mut tail = [0u8; 1];
            pattern::fill_at_byte(&mut tail, land_seed, n as u64 - 1);
            self.local.buf.write_at(half + n - 1, &tail);
        }
        self.ch.barrier(step + 1)?;
        let mut verdict: anyhow::Result<()> = Ok(());
        if a.end.verify
            && let Err(m) = pattern::check_buf(&self.local.buf, half, n, land_seed)
        {
            verdict = Err(anyhow!(
                "verification failed on the {} at size {size}: {m}",
                self.side()
            ));
        }
        if self.client {
            if a.end.verify {
                let (ok, detail) = self.ch.recv_verified()?;
                if !ok && verdict.is_ok() {
                    verdict = Err(anyhow!(
                        "verification failed on the server at size {size}: {detail}"
                    ));
                }
            }
            let r = stats::lat_result(size, iters, &posted, 2.0);
            self.ch.send(&Msg::Lat { result: r })?;
            Ok((r, verdict))
        } else {
            if a.end.verify {
                let (ok, detail) = match &verdict {
                    Ok(()) => (true, String::new()),
                    Err(e) => (false, e.to_string()),
                };
                self.ch.send(&Msg::Verified { size, ok, detail })?;
            }
            let r = self.ch.recv_lat()?;
            Ok((r, verdict))
        }
    }

    /// Waits for ping `tag`: spinning on byte `off` of our buffer until it reads `mark`
    /// (`--poll-memory`), or for the engine's notification.
    fn wait_ping(&self, poll: bool, tag: u32, off: usize, mark: u8) -> anyhow::Result<()> {
        if !poll {
            return self.wait_note(tag);
        }
        // The deadline is set at the first clock check, so a ping that arrives within
        // 4096 spins costs no clock read.
        let mut deadline: Option<Instant> = None;
        let mut spins = 0u32;
        while peek(&self.local.buf, off) != mark {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                let now = Instant::now();
                if now >= *deadline.get_or_insert(now + self.timeout) {
                    bail!("ping {tag} did not arrive within {:?}", self.timeout);
                }
            }
        }
        Ok(())
    }

    fn wait_note(&self, tag: u32) -> anyhow::Result<()> {
        let n = self
            .engine
            .poll_notification(Instant::now() + self.timeout)
            .ok_or_else(|| {
                anyhow!(
                    "no notification {tag} from the peer within {:?}",
                    self.timeout
                )
            })?;
        ensure!(
            n.peer == self.peer && n.tag == tag,
            "unexpected notification {} from {} (expected {tag})",
            n.tag,
            n.peer
        );
        Ok(())
    }
}

/// Reads one byte of a registered buffer that the peer may be writing at this moment.
fn peek(buf: &pagewire_transport::HostBuffer, off: usize) -> u8 {
    assert!(
        off < buf.len(),
        "peek at {off} outside a {} B buffer",
        buf.len()
    );
    // SAFETY: `off` is inside the buffer's allocation (checked above), which lives while
    // `buf` is borrowed. `AtomicU8` has the layout of `u8` and every bit pattern is valid,
    // so an atomic load of a byte that the NIC or the engine writes concurrently reads
    // some value it held; being atomic, the load is not hoisted out of the polling loop.
    let cell = unsafe { std::sync::atomic::AtomicU8::from_ptr(buf.as_mut_ptr().add(off)) };
    cell.load(std::sync::atomic::Ordering::Acquire)
}
