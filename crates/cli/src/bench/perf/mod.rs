//! `pagewire bench write|read|lat` over the transport engine.
//!
//! Each end registers one buffer of twice the largest message (rounded up to a page): the
//! lower half is what it sends (or lets the peer read), the upper half is where the
//! peer's data lands.
//!
//! * this file: the roles (server, client, both in this process), each end's engine and
//!   buffer, and the meeting on the side channel;
//! * `driver`: the one loop over sizes that both kinds of test run in (fill, barrier,
//!   measure, barrier, verify, exchange, print);
//! * `bw`: what `write` and `read` measure (bandwidth of a window of operations);
//! * `lat`: what `lat` measures (a ping-pong's round trips).
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use pagewire_transport::Engine;

use super::args::{PerfArgs, Role, TestKind, TransportArg};
use super::oob::{Msg, Welcome};
use super::session::{self, EngineOpts, Local};

mod bw;
mod driver;
mod lat;

use driver::End;

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
            let end = Unmet::open(kind, &args, transport, &sizes, false)?;
            end.run_client(kind, &args, &sizes, server)
        }
        Role::Server => {
            let listener = TcpListener::bind(("0.0.0.0", args.end.port))
                .with_context(|| format!("binding the side channel on port {}", args.end.port))?;
            session::check_memory(buf, "this run's buffer", "use a smaller -s")?;
            let end = Unmet::open(kind, &args, transport, &sizes, false)?;
            end.serve(kind, &args, &sizes, listener, false)
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
    let server_end = Unmet::open(kind, args, transport, sizes, true)?;
    let client_end = Unmet::open(kind, args, transport, sizes, true)?;
    let (a2, s2) = (args.clone(), sizes.to_vec());
    let (addr, t) =
        session::spawn_local_server(move |l| server_end.serve(kind, &a2, &s2, l, true))?;
    let r = client_end.run_client(kind, args, sizes, addr);
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

/// One end before it meets the other: its engine open, its buffer registered (so a
/// transport that cannot be used fails here, with its reason, before any connection).
struct Unmet {
    engine: Engine,
    local: Local,
    half: u64,
}

impl Unmet {
    /// `in_process`: both ends run here, so the engine listens on 127.0.0.1 only.
    fn open(
        kind: TestKind,
        args: &PerfArgs,
        transport: TransportArg,
        sizes: &[u64],
        in_process: bool,
    ) -> anyhow::Result<Unmet> {
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
        Ok(Unmet {
            engine,
            local,
            half,
        })
    }

    /// The server: waits for one client, runs the test with it, and returns. A client
    /// that said a valid hello but then fails the engine handshake (or vanishes) is
    /// logged and dropped like a foreign connection; the server keeps waiting. `quiet`:
    /// the in-process server, which prints nothing (the client prints the report).
    fn serve(
        self,
        kind: TestKind,
        args: &PerfArgs,
        sizes: &[u64],
        listener: TcpListener,
        quiet: bool,
    ) -> anyhow::Result<()> {
        let Unmet {
            engine,
            local,
            half,
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
        let end = End {
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
        drive(end, kind, args, sizes)
    }

    /// The client: meets the server at `server` and runs the test with it.
    fn run_client(
        self,
        kind: TestKind,
        args: &PerfArgs,
        sizes: &[u64],
        server: SocketAddr,
    ) -> anyhow::Result<()> {
        let Unmet {
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
        let end = End {
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
        drive(end, kind, args, sizes)
    }
}

/// Runs the test over a connected pair with the measurement `kind` needs, then closes
/// this end's engine.
fn drive(mut end: End, kind: TestKind, args: &PerfArgs, sizes: &[u64]) -> anyhow::Result<()> {
    let r = match kind {
        TestKind::Lat => end.run_all(&lat::Latency { a: args }, args, sizes),
        TestKind::Write | TestKind::Read => {
            end.run_all(&bw::Bandwidth { kind, a: args }, args, sizes)
        }
    };
    end.engine.shutdown();
    r
}
