//! `lat`: a WRITE ping-pong. The client writes `size` bytes tagged with the iteration
//! number, the server waits for that notification and writes back. The engine surfaces
//! a notification only once every byte of the batch is in memory, on every backend, so
//! each half round trip is the time for the data to arrive *and* be known to have
//! arrived (perftest instead spins on the last byte, which only verbs guarantees to
//! land last; `--poll-memory` does that too).
use std::time::Instant;

use anyhow::{Context, anyhow, bail, ensure};
use pagewire_transport::{Batch, BatchStatus, TransferHandle};

use super::driver::{End, Flows, Measure};
use crate::bench::args::{PerfArgs, TestKind};
use crate::bench::pattern;
use crate::bench::progress::{Progress, Unit};
use crate::bench::stats::{self, LatResult};

/// The ping-pong latency under the flags `a`.
pub(super) struct Latency<'a> {
    pub a: &'a PerfArgs,
}

impl Measure for Latency<'_> {
    type Row = LatResult;

    fn kind(&self) -> TestKind {
        TestKind::Lat
    }

    /// Both ends send a ping and receive one.
    fn flows(&self, _client: bool) -> Flows {
        Flows {
            source: true,
            lands: true,
        }
    }

    fn progress_bar(&self, sizes: u64, enabled: bool) -> Progress {
        let n = sizes * self.a.iters(TestKind::Lat);
        Progress::new(n, Unit::Count("pings"), enabled, 64)
    }

    /// The client's round trips; the server measures nothing (it only answers).
    fn measure(
        &self,
        end: &mut End,
        size: u64,
        land_seed: u64,
        bar: &mut Progress,
    ) -> anyhow::Result<Option<LatResult>> {
        let a = self.a;
        let iters = a.iters(TestKind::Lat);
        let (half, n) = (end.half as usize, size as usize);
        let (src, dst) = (end.lower(), end.remote.addr + end.half);
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
            let mut b = Batch::new().write(src, dst, size).timeout(end.timeout);
            if !poll {
                b = b.notify(0);
            }
            Some(
                end.engine
                    .prepare(end.peer, b)
                    .context("preparing the ping")?,
            )
        };
        let start = Instant::now();
        let mut posted = Vec::with_capacity(iters as usize);
        let mut last: Option<TransferHandle> = None;
        for i in 0..iters {
            let tag = i as u32;
            if !end.client {
                wait_ping(end, poll, tag, half + n - 1, mark(i))?;
            }
            if poll {
                end.local.buf.write_at(n - 1, &[mark(i)]);
            }
            // One clock read per ping, as perftest's one cycle-counter read: the post
            // time, which also anchors the deadlines.
            let t = Instant::now();
            if let Some(p) = &mut prepared {
                let deadline = t + end.timeout;
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
                let mut b = Batch::new().write(src, dst, size).deadline(t + end.timeout);
                if !poll {
                    b = b.notify(tag);
                }
                let h = end
                    .engine
                    .submit(end.peer, b)
                    .context("submitting a ping")?;
                posted.push(t.duration_since(start).as_nanos() as u64);
                // Right after the post and off the critical path (the peer is detecting
                // the ping meanwhile). With --poll-memory, wait for the ping's own
                // completion as ib_write_lat polls its send CQ: the waiter reaps it on
                // this thread, and the engine's completion thread stays out of the way of
                // the two spinning processes. With notifications the wait for the pong
                // reaps it anyway.
                if poll {
                    h.wait(t + end.timeout)
                        .with_context(|| format!("ping {i}"))?;
                } else if let BatchStatus::Failed(e) = h.status() {
                    bail!("ping {i} failed: {e}");
                }
                last = Some(h);
            }
            if end.client {
                wait_ping(end, poll, tag, half + n - 1, mark(i))?;
            }
            bar.add(1);
        }
        if let Some(h) = last {
            h.wait(Instant::now() + end.timeout)
                .context("the last ping")?;
        }
        if let Some(p) = &mut prepared {
            p.wait(Instant::now() + end.timeout)
                .context("the last ping")?;
        }
        if poll {
            // The last byte carried the marks; the rest must still be the pattern.
            let want = mark(iters - 1);
            let got = peek(&end.local.buf, half + n - 1);
            if a.end.verify && got != want {
                bail!("the last ping's final byte is {got:#04x}, expected {want:#04x}");
            }
            let mut tail = [0u8; 1];
            pattern::fill_at_byte(&mut tail, land_seed, n as u64 - 1);
            end.local.buf.write_at(half + n - 1, &tail);
        }
        Ok(end
            .client
            .then(|| stats::lat_result(size, iters, &posted, 2.0)))
    }

    /// Never called: the latency server measures nothing.
    fn combine(&self, client: LatResult, _server: &LatResult) -> LatResult {
        client
    }
}

/// Waits for ping `tag`: spinning on byte `off` of our buffer until it reads `mark`
/// (`--poll-memory`), or for the engine's notification.
fn wait_ping(end: &End, poll: bool, tag: u32, off: usize, mark: u8) -> anyhow::Result<()> {
    if !poll {
        return wait_note(end, tag);
    }
    // The deadline is set at the first clock check, so a ping that arrives within
    // 4096 spins costs no clock read.
    let mut deadline: Option<Instant> = None;
    let mut spins = 0u32;
    while peek(&end.local.buf, off) != mark {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) {
            let now = Instant::now();
            if now >= *deadline.get_or_insert(now + end.timeout) {
                bail!("ping {tag} did not arrive within {:?}", end.timeout);
            }
        }
    }
    Ok(())
}

fn wait_note(end: &End, tag: u32) -> anyhow::Result<()> {
    let n = end
        .engine
        .poll_notification(Instant::now() + end.timeout)
        .ok_or_else(|| {
            anyhow!(
                "no notification {tag} from the peer within {:?}",
                end.timeout
            )
        })?;
    ensure!(
        n.peer == end.peer && n.tag == tag,
        "unexpected notification {} from {} (expected {tag})",
        n.tag,
        n.peer
    );
    Ok(())
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
