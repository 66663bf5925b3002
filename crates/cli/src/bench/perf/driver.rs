//! The one driver of `write`, `read` and `lat` once both ends have met: for each size it
//! fills the buffers, meets the peer, lets the test measure, meets again, checks the
//! landed bytes and exchanges verdicts and figures; then it prints the row. A test
//! ([`Measure`]) says only which buffers it sends from and lands in, and what it
//! measures between the two meetings: bandwidth ([`super::bw`]) or a ping-pong's
//! latency ([`super::lat`]).
use std::io::Write as _;
use std::time::Duration;

use anyhow::anyhow;
use pagewire_transport::{Engine, PeerId, RemoteRegion};

use crate::bench::args::{PerfArgs, TestKind};
use crate::bench::oob::{Channel, Msg, OobError};
use crate::bench::pattern;
use crate::bench::progress::{self, Progress};
use crate::bench::report::{Printer, RunInfo};
use crate::bench::session::{self, Local};
use crate::bench::stats::{BwResult, LatResult};

/// One report row: how it travels on the side channel and how it is printed.
pub(super) trait Row: Copy {
    fn send(self, ch: &mut Channel) -> Result<(), OobError>;
    fn recv(ch: &mut Channel) -> Result<Self, OobError>;
    fn print<W: std::io::Write>(
        &self,
        p: &mut Printer<W>,
        verified: Option<bool>,
    ) -> std::io::Result<()>;
}

impl Row for BwResult {
    fn send(self, ch: &mut Channel) -> Result<(), OobError> {
        ch.send(&Msg::Bw { result: self })
    }
    fn recv(ch: &mut Channel) -> Result<Self, OobError> {
        ch.recv_bw()
    }
    fn print<W: std::io::Write>(
        &self,
        p: &mut Printer<W>,
        verified: Option<bool>,
    ) -> std::io::Result<()> {
        p.bw(self, verified)
    }
}

impl Row for LatResult {
    fn send(self, ch: &mut Channel) -> Result<(), OobError> {
        ch.send(&Msg::Lat { result: self })
    }
    fn recv(ch: &mut Channel) -> Result<Self, OobError> {
        ch.recv_lat()
    }
    fn print<W: std::io::Write>(
        &self,
        p: &mut Printer<W>,
        verified: Option<bool>,
    ) -> std::io::Result<()> {
        p.lat(self, verified)
    }
}

/// What a test measures at one size; [`End::run_all`] does everything else.
pub(super) trait Measure {
    type Row: Row;

    fn kind(&self) -> TestKind;

    /// Whether this end's lower half is a source (filled with this end's pattern before
    /// the clock starts) and whether the peer's data lands in its upper half (zeroed
    /// before, checked after with --verify).
    fn flows(&self, client: bool) -> Flows;

    /// The run's progress bar: what this end counts, out of how many.
    fn progress_bar(&self, sizes: u64, enabled: bool) -> Progress;

    /// Runs one size between the barrier that starts it and the one that ends it.
    /// Returns this end's own figures: the client's always, the server's only when
    /// [`Measure::server_measures`].
    fn measure(
        &self,
        end: &mut End,
        size: u64,
        land_seed: u64,
        bar: &mut Progress,
    ) -> anyhow::Result<Option<Self::Row>>;

    /// How long this end may wait at the barrier that ends a size: a passive end waits
    /// out the initiator's whole run there.
    fn settle_timeout(&self, timeout: Duration) -> Duration {
        timeout
    }

    /// The server measures too (a bidirectional run): the client's row is then
    /// [`Measure::combine`] of both ends' figures.
    fn server_measures(&self) -> bool {
        false
    }

    /// The client's figures and the server's as one row.
    fn combine(&self, client: Self::Row, server: &Self::Row) -> Self::Row;
}

/// Which halves of an end's buffer a test uses at one size.
#[derive(Debug, Clone, Copy)]
pub(super) struct Flows {
    /// The lower half is read from (by this end's writes or the peer's reads).
    pub source: bool,
    /// The peer's data lands in the upper half.
    pub lands: bool,
}

/// One end of a connected pair.
pub(super) struct End {
    pub engine: Engine,
    pub peer: PeerId,
    pub local: Local,
    pub remote: RemoteRegion,
    pub ch: Channel,
    pub client: bool,
    pub print: bool,
    /// Offset of the landing half in both buffers.
    pub half: u64,
    pub timeout: Duration,
}

impl End {
    /// Runs every size of the test and prints the report (on the printing end).
    pub fn run_all<M: Measure>(
        &mut self,
        m: &M,
        args: &PerfArgs,
        sizes: &[u64],
    ) -> anyhow::Result<()> {
        let kind = m.kind();
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
            printer.begin(&header, kind == TestKind::Lat, !args.peak_enabled(kind))?;
        }
        // Drawn only past two seconds, on a terminal, without --json.
        let mut bar = m.progress_bar(
            sizes.len() as u64,
            progress::wanted(args.end.json, self.print),
        );
        self.ch.barrier(0)?;
        let mut failure = None;
        // The verdict a record carries: only with --verify.
        let verified = |v: &anyhow::Result<()>| args.end.verify.then_some(v.is_ok());
        for (i, &size) in sizes.iter().enumerate() {
            let step = 1 + 4 * i as u64;
            let (r, verdict) = self.run_size(m, step, size, args.end.verify, &mut bar)?;
            if self.print {
                bar.suspend(|| r.print(&mut printer, verified(&verdict)))?;
            }
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

    /// One size: fill, barrier, measure, barrier, verify, exchange verdicts and figures.
    /// Returns the row to print and the verification verdict.
    fn run_size<M: Measure>(
        &mut self,
        m: &M,
        step: u64,
        size: u64,
        verify: bool,
        bar: &mut Progress,
    ) -> anyhow::Result<(M::Row, anyhow::Result<()>)> {
        let here = m.flows(self.client);
        let peer_lands = m.flows(!self.client).lands;
        // Data that starts in the client's memory uses direction 0, the server's 1.
        let (mine, theirs) = if self.client { (0, 1) } else { (1, 0) };
        let name = m.kind().name();
        let src_seed = pattern::seed_for(name, size, mine);
        let land_seed = pattern::seed_for(name, size, theirs);
        let (half, n) = (self.half as usize, size as usize);
        // Always, not only with --verify: it also faults every page in before the clock starts.
        if here.source {
            pattern::fill_buf(&mut self.local.buf, 0, n, src_seed);
        }
        if here.lands {
            self.local.buf.fill_range(half..half + n, 0);
        }
        self.ch.barrier(step)?;
        let mine = m.measure(self, size, land_seed, bar)?;
        self.ch.set_timeout(m.settle_timeout(self.timeout))?;
        self.ch.barrier(step + 1)?;
        self.ch.set_timeout(self.timeout)?;
        let mut verdict: anyhow::Result<()> = Ok(());
        if verify
            && here.lands
            && let Err(e) = pattern::check_buf(&self.local.buf, half, n, land_seed)
        {
            verdict = Err(anyhow!(
                "verification failed on the {} at size {size}: {e}",
                self.side()
            ));
        }
        if self.client {
            if verify && peer_lands {
                let (ok, detail) = self.ch.recv_verified()?;
                if !ok && verdict.is_ok() {
                    verdict = Err(anyhow!(
                        "verification failed on the server at size {size}: {detail}"
                    ));
                }
            }
            let mut r = mine.expect("the client measures");
            if m.server_measures() {
                let theirs = M::Row::recv(&mut self.ch)?;
                r = m.combine(r, &theirs);
            }
            r.send(&mut self.ch)?;
            Ok((r, verdict))
        } else {
            if verify && here.lands {
                let (ok, detail) = match &verdict {
                    Ok(()) => (true, String::new()),
                    Err(e) => (false, e.to_string()),
                };
                self.ch.send(&Msg::Verified { size, ok, detail })?;
            }
            if let Some(r) = mine {
                r.send(&mut self.ch)?;
            }
            let total = M::Row::recv(&mut self.ch)?;
            Ok((total, verdict))
        }
    }

    pub fn side(&self) -> &'static str {
        if self.client { "client" } else { "server" }
    }

    /// Address of the lower (source) half of this end's buffer.
    pub fn lower(&self) -> u64 {
        self.local.base()
    }
}
