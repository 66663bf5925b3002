//! `write` and `read`: the initiator keeps at most `-t` operations in flight, posted in
//! batches of `-Q` (one completion per batch, like perftest's CQ moderation), and takes
//! each operation's post and completion time around `Engine::submit` and
//! `TransferHandle::wait`. The client always initiates; with `-b` the server does too,
//! at the same time, and the client's row sums both ends.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::Context;
use pagewire_transport::{Batch, Op, TransferHandle, TransferOp};

use super::driver::{End, Flows, Measure};
use crate::bench::args::{PerfArgs, TestKind};
use crate::bench::progress::{Progress, Unit};
use crate::bench::stats::{self, BwResult, BwSamples};

/// The bandwidth of `kind` (WRITE or READ) under the flags `a`.
pub(super) struct Bandwidth<'a> {
    pub kind: TestKind,
    pub a: &'a PerfArgs,
}

impl Bandwidth<'_> {
    /// This end posts operations at this size.
    fn initiates(&self, client: bool) -> bool {
        client || self.a.bidirectional
    }
}

impl Measure for Bandwidth<'_> {
    type Row = BwResult;

    fn kind(&self) -> TestKind {
        self.kind
    }

    fn flows(&self, client: bool) -> Flows {
        let initiates = self.initiates(client);
        let peer_initiates = self.initiates(!client);
        match self.kind {
            // A READ takes the data from the peer's memory into the initiator's.
            TestKind::Read => Flows {
                source: peer_initiates,
                lands: initiates,
            },
            _ => Flows {
                source: initiates,
                lands: peer_initiates,
            },
        }
    }

    /// Operations this end initiates, or the clock of a timed run.
    fn progress_bar(&self, sizes: u64, enabled: bool) -> Progress {
        let (a, kind) = (self.a, self.kind);
        match a.duration {
            Some(d) => Progress::new(sizes * (d * 1e3) as u64, Unit::Millis, enabled, 1),
            None => Progress::new(
                sizes * a.iters(kind) * u64::from(a.qps),
                Unit::Count("ops"),
                enabled,
                1,
            ),
        }
    }

    fn measure(
        &self,
        end: &mut End,
        size: u64,
        _land_seed: u64,
        bar: &mut Progress,
    ) -> anyhow::Result<Option<BwResult>> {
        let (a, kind) = (self.a, self.kind);
        if !self.initiates(end.client) {
            // A passive end moves its bar by the size it waited out.
            bar.add(a.iters(kind) * u64::from(a.qps));
            return Ok(None);
        }
        let (op, local, remote) = match kind {
            TestKind::Read => (Op::Read, end.lower() + end.half, end.remote.addr),
            _ => (Op::Write, end.lower(), end.remote.addr + end.half),
        };
        let total = a.iters(kind) * u64::from(a.qps);
        let dur = a.duration.map(Duration::from_secs_f64);
        let warm = a.warm_up_ops(kind);
        let (depth, cq_mod) = (a.tx_depth(kind), a.cq_mod(kind));
        let one = TransferOp {
            op,
            local,
            remote,
            len: size,
        };
        if warm > 0 {
            bw_loop(end, one, warm, None, depth, cq_mod, &mut Progress::hidden())
                .context("warming up")?;
        }
        let samples = bw_loop(end, one, total, dur, depth, cq_mod, bar)?;
        let (samples, iterations) = match a.duration {
            Some(d) => {
                let m = a.effective_margin();
                let w = stats::trim_window(&samples, (m * 1e9) as u64, ((d - m) * 1e9) as u64);
                let it = w.posted.len() as u64 / u64::from(a.qps);
                (w, it)
            }
            None => (samples, a.iters(kind)),
        };
        let cq = cq_mod as usize;
        Ok(Some(stats::bw_result(
            size,
            iterations,
            &samples,
            cq,
            cq,
            a.peak_enabled(kind),
        )))
    }

    /// `timeout` bounds each of the initiator's batch waits, not its whole run; a passive
    /// side that waited only `timeout` at the closing barrier dropped its engine under a
    /// long run (the initiator then saw "peer gone"). A peer that dies still shows up at
    /// once as EOF.
    fn settle_timeout(&self, timeout: Duration) -> Duration {
        let (a, kind) = (self.a, self.kind);
        let cq = u64::from(a.cq_mod(kind).max(1));
        let waits = match a.duration {
            Some(_) => u64::from(a.tx_depth(kind)).div_ceil(cq),
            None => (a.iters(kind) * u64::from(a.qps)).div_ceil(cq),
        } + a.warm_up_ops(kind).div_ceil(cq);
        let waits = u32::try_from(waits.saturating_add(1)).unwrap_or(u32::MAX);
        Duration::try_from_secs_f64(a.duration.unwrap_or(0.0))
            .unwrap_or(Duration::MAX)
            .saturating_add(timeout.saturating_mul(waits))
    }

    fn server_measures(&self) -> bool {
        self.a.bidirectional
    }

    fn combine(&self, client: BwResult, server: &BwResult) -> BwResult {
        client.sum(server)
    }
}

/// Posts `total` copies of `one` (or runs for `duration`) with at most `depth` in flight,
/// in batches of `cq_mod`, and returns each op's post and completion time.
fn bw_loop(
    end: &End,
    one: TransferOp,
    total: u64,
    duration: Option<Duration>,
    depth: u32,
    cq_mod: u32,
    bar: &mut Progress,
) -> anyhow::Result<BwSamples> {
    let size = one.len;
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
            let b = b.timeout(end.timeout);
            let t = ns(Instant::now());
            let h = end
                .engine
                .submit(end.peer, b)
                .context("submitting a batch")?;
            s.posted.extend(std::iter::repeat_n(t, cnt));
            inflight.push_back((h, cnt));
            outstanding += cnt;
            posted += cnt as u64;
        }
        let Some((h, cnt)) = inflight.pop_front() else {
            break;
        };
        h.wait(Instant::now() + end.timeout)
            .with_context(|| format!("{size} B batch (op {} of the run)", s.completed.len()))?;
        let t = ns(Instant::now());
        s.completed.extend(std::iter::repeat_n(t, cnt));
        outstanding -= cnt;
        bar.add(cnt as u64);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(argv: &[&str]) -> PerfArgs {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            a: crate::bench::args::BwArgs,
        }
        Wrap::try_parse_from(std::iter::once("bw").chain(argv.iter().copied()))
            .unwrap()
            .a
            .into()
    }

    /// (client source, client lands, server source, server lands): what the driver fills,
    /// zeroes and checks on each end. The driver reads the peer's `lands` from the same
    /// table, so a wrong entry would skip or invent a verdict.
    fn table(kind: TestKind, a: &PerfArgs) -> [bool; 4] {
        let m = Bandwidth { kind, a };
        let (c, s) = (m.flows(true), m.flows(false));
        [c.source, c.lands, s.source, s.lands]
    }

    #[test]
    fn flows_follow_the_op_and_who_initiates() {
        let one = args(&[]);
        let both = args(&["-b"]);
        // WRITE: the client's data lands at the server.
        assert_eq!(table(TestKind::Write, &one), [true, false, false, true]);
        // READ: the client pulls the server's data into its own buffer.
        assert_eq!(table(TestKind::Read, &one), [false, true, true, false]);
        // Bidirectional: both ends send and both receive, and the server measures too.
        assert_eq!(table(TestKind::Write, &both), [true; 4]);
        assert_eq!(table(TestKind::Read, &both), [true; 4]);
        let (m1, m2) = (
            Bandwidth {
                kind: TestKind::Write,
                a: &one,
            },
            Bandwidth {
                kind: TestKind::Write,
                a: &both,
            },
        );
        assert!(!m1.server_measures() && m2.server_measures());
    }
}
