//! The roles of a run (server, client, or both in this process), the meeting on the side
//! channel, and the client's timed loop of page batches.
use pagewire_layout::PoolGeometry;

use super::PagesArgs;
use super::presets::{geometry, place, pool_bytes};
use super::report::{Measured, PagesReport};
use super::verify::verify_pool;
use super::workload::{PageOp, mapping, plan_stats, source_seed};
use crate::bench::args::{Role, TransportArg};
use crate::bench::progress::{self, Progress, Unit};
use crate::bench::session::{self, EngineOpts, Local};

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
            crate::bench::pattern::fill_buf(&mut self.local.buf, 0, len, source_seed(a));
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
        use crate::bench::oob::{Msg, Welcome};
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
        let report = PagesReport::new(
            a,
            &g,
            &info,
            Measured {
                plan: pstats,
                plan_build_us,
                seconds: secs,
                batch_us: lat_us,
                verified: &verified,
            },
        );
        report.print(a.end.json)?;
        if let Some(Err(e)) = verified {
            return Err(anyhow!("verification failed on the {e}"));
        }
        Ok(report)
    }
}
