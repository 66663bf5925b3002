//! The transport conformance suite: written once in `suite`, instantiated per backend by
//! `backend_suite!` (loopback and tcp always; verbs with the `verbs` feature: `#[ignore]`d
//! on a host, run in the soft-RoCE VM with `--include-ignored` and `RDMA_DEVICE`).
//!
//! Every transfer is verified byte for byte on the receiving side, with guard bytes
//! around the target to catch stray writes. `PAGEWIRE_TEST_MAX_BYTES` caps the size
//! sweep (default 64 MiB) for slow links such as rxe under TCG; `PAGEWIRE_TEST_MANY_OPS`
//! sets the op count of the one-huge-batch test (default 200,000; 16,384 with SOFTROCE=1).

mod common;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::*;
use pagewire_layout::{Layout, Pool, PoolGeometry, PoolKind};
use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Error, HandshakeError, Op, TransferOp,
};

mod suite {
    use super::*;

    /// Writes then reads back sizes from 1 byte to `max_bytes()` at odd offsets; the last
    /// write carries a notification, and its bytes are checked the moment it arrives.
    pub fn write_read_sizes(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let max = max_bytes() as usize;
        let cap = max + 2 * 4096;
        let (mut src, _) = buffer(&a, cap, Access::LOCAL_WRITE)?;
        let (mut back, _) = buffer(&a, cap, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, cap, Access::ALL)?;
        fill_pattern(&mut src, 1);
        let (ab, ba) = connect(&a, &b)?;
        let mut sizes: Vec<usize> = vec![
            1,
            3,
            4095,
            4096,
            4097,
            65536 + 7,
            1 << 20,
            (1 << 20) + 1,
            (4 << 20) - 3,
            16 << 20,
            64 << 20,
        ];
        sizes.retain(|&s| s <= max);
        if *sizes.last().expect("1 byte always fits") != max {
            sizes.push(max);
        }
        for (i, &n) in sizes.iter().enumerate() {
            let (soff, doff) = (13 + i, 4096 - (i % 7));
            dst.fill(GUARD);
            let tag = 1000 + i as u32;
            let h = a.submit(
                ab,
                Batch::new()
                    .write(src.addr() + soff as u64, dst.addr() + doff as u64, n as u64)
                    .notify(tag),
            )?;
            let note = b
                .poll_notification(secs(60))
                .with_context(|| format!("no notification for {n} bytes"))?;
            ensure!(note.peer == ba && note.tag == tag, "notification {note:?}");
            // The notification alone must guarantee the bytes are there.
            check_landed(&dst, doff, &src, soff, n).with_context(|| format!("WRITE {n} B"))?;
            let st = h.wait(secs(60)).with_context(|| format!("WRITE {n} B"))?;
            ensure!(st.bytes == n as u64, "stats {st:?}");

            back.fill(GUARD);
            let boff = 4096 + (i % 5);
            a.submit(
                ab,
                Batch::new().read(
                    back.addr() + boff as u64,
                    dst.addr() + doff as u64,
                    n as u64,
                ),
            )?
            .wait(secs(60))
            .with_context(|| format!("READ {n} B"))?;
            check_landed(&back, boff, &src, soff, n).with_context(|| format!("READ {n} B"))?;
        }
        Ok(())
    }

    /// Scattered pages from a real layout plan: page_first source, page_first_direct
    /// destination, non-contiguous page lists, written with a notification and read back.
    pub fn layout_plan_pages(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let geometry = PoolGeometry::builder(PoolKind::Mha)
            .layers(4)
            .page_size(16)
            .heads(4)
            .head_dim(64)
            .dtype_bytes(2)
            .capacity(64 * 16)
            .build()?;
        let pool_bytes = 2 * geometry.buffer_bytes(pagewire_layout::Component::K) as usize;
        let (mut src, _) = buffer(&a, pool_bytes, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, pool_bytes, Access::ALL)?;
        fill_pattern(&mut src, 7);
        dst.fill(GUARD);
        let src_pool = Pool::new(geometry, Layout::PageFirst, src.addr(), None)?;
        let dst_pool = Pool::new(geometry, Layout::PageFirstDirect, dst.addr(), None)?;
        let src_pages = [3u64, 10, 11, 12, 40, 63, 0];
        let dst_pages = [7u64, 2, 3, 4, 60, 1, 33];
        let plan = pagewire_layout::plan(&src_pool, &dst_pool, &src_pages, &dst_pages)?;
        ensure!(plan.len() > src_pages.len(), "plan should be scattered");
        let (ab, _ba) = connect(&a, &b)?;
        a.submit_plan(ab, Op::Write, &plan, Some(42))?
            .wait(secs(60))?;
        let note = b.poll_notification(secs(10)).context("notification")?;
        ensure!(note.tag == 42);
        // Byte-exact per plan entry, and nothing else touched.
        let mut expect = vec![GUARD; pool_bytes];
        for t in &plan {
            let (s, d, n) = (
                (t.src - src.addr()) as usize,
                (t.dst - dst.addr()) as usize,
                t.len as usize,
            );
            expect[d..d + n].copy_from_slice(&src.read_vec(s..s + n));
        }
        ensure!(
            dst.to_vec() == expect[..],
            "destination pool differs from the plan"
        );

        // And the decode side pulls the same pages back with READs of the reverse plan.
        let (mut back, _) = buffer(&a, pool_bytes, Access::LOCAL_WRITE)?;
        back.fill(GUARD);
        let back_pool = Pool::new(geometry, Layout::PageFirst, back.addr(), None)?;
        let pull = pagewire_layout::plan(&dst_pool, &back_pool, &dst_pages, &src_pages)?;
        a.submit_plan(ab, Op::Read, &pull, None)?.wait(secs(60))?;
        for t in &plan {
            let s = (t.src - src.addr()) as usize;
            let n = t.len as usize;
            ensure!(
                back.read_vec(s..s + n) == src.read_vec(s..s + n),
                "READ plan mismatch at {s}"
            );
        }
        Ok(())
    }

    /// Many batches in flight to one peer, and three peers writing into one engine at once;
    /// every (peer, tag) notification arrives exactly once and all bytes are exact.
    /// Tags of single-WRITE batches from one peer each come out once, with their write's
    /// bytes in place, whichever thread reaps them: bursts sent without waiting (several
    /// tags per reaping round on the waiter's own thread) and single tags, mixing
    /// `poll_notification` and `try_notification`. Verbs (one QP carries them all) and
    /// loopback keep the sending order; TCP spreads batches over its streams and does not.
    pub fn notifications_in_order(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        const N: u32 = 300;
        let (mut src, _) = buffer(&a, 64 * N as usize, Access::LOCAL_WRITE)?;
        let (dst, _) = buffer(&b, 64 * N as usize, Access::ALL)?;
        fill_pattern(&mut src, 21);
        let (ab, _ba) = connect(&a, &b)?;
        let mut handles = Vec::new();
        let mut got = Vec::with_capacity(N as usize);
        for tag in 0..N {
            let off = 64 * u64::from(tag);
            handles.push(
                a.submit(
                    ab,
                    Batch::new()
                        .write(src.addr() + off, dst.addr() + off, 64)
                        .notify(tag),
                )?,
            );
            // Bursts of 25, then drain them.
            if tag % 25 != 24 {
                continue;
            }
            while got.len() <= tag as usize {
                let n = if got.len() % 7 == 3 {
                    let t0 = Instant::now();
                    loop {
                        if let Some(n) = b.try_notification() {
                            break n;
                        }
                        ensure!(
                            t0.elapsed() < Duration::from_secs(30),
                            "notification {} never came",
                            got.len()
                        );
                        std::thread::yield_now();
                    }
                } else {
                    b.poll_notification(secs(30))
                        .with_context(|| format!("notification {}", got.len()))?
                };
                let o = 64 * n.tag as usize;
                ensure!(n.tag < N, "unknown tag {}", n.tag);
                ensure!(
                    dst.read_vec(o..o + 64) == src.read_vec(o..o + 64),
                    "tag {}: bytes not in place",
                    n.tag
                );
                got.push(n.tag);
            }
        }
        for h in handles {
            h.wait(secs(30))?;
        }
        ensure!(b.try_notification().is_none(), "an extra notification");
        let in_order = got.iter().copied().eq(0..N);
        got.sort_unstable();
        ensure!(got.iter().copied().eq(0..N), "a tag lost or repeated");
        ensure!(
            in_order || kind == BackendKind::Tcp,
            "tags out of sending order on {kind:?}"
        );
        Ok(())
    }

    /// A notification with no data: the tag arrives alone, the batch completes, and a tag
    /// sent after a completed write finds that write's bytes in place. An empty batch
    /// without a notification stays an error (in `permissions`).
    pub fn notify_only(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let (mut src, _) = buffer(&a, 1 << 16, Access::LOCAL_WRITE)?;
        let (dst, _) = buffer(&b, 1 << 16, Access::ALL)?;
        fill_pattern(&mut src, 3);
        let (ab, _ba) = connect(&a, &b)?;
        for tag in [7u32, 8, 9] {
            let stats = a.submit(ab, Batch::new().notify(tag))?.wait(secs(30))?;
            ensure!(stats.bytes == 0, "a tag alone moved {} bytes", stats.bytes);
            let n = b
                .poll_notification(secs(10))
                .context("notification alone")?;
            ensure!(n.tag == tag, "got tag {}, expected {tag}", n.tag);
        }
        a.submit(ab, Batch::new().write(src.addr(), dst.addr(), 1 << 16))?
            .wait(secs(30))?;
        a.submit(ab, Batch::new().notify(10))?.wait(secs(30))?;
        let n = b
            .poll_notification(secs(10))
            .context("notification after a write")?;
        ensure!(n.tag == 10);
        ensure!(
            dst.to_vec() == src.to_vec(),
            "the write's bytes were not in place at its tag"
        );
        ensure!(b.try_notification().is_none(), "an extra notification");
        Ok(())
    }

    /// A batch with a notification, one of whose writes the peer refuses (its target was
    /// deregistered after we learnt it): the batch fails and the peer surfaces no tag,
    /// although the writes before and after the refused one land. Small enough that TCP
    /// sends the tag in the data's burst, where the responder must skip it. A good batch
    /// on the same connection is notified afterwards (where the connection survived the
    /// refusal: not on verbs, whose QP went to error).
    pub fn refused_write_is_not_notified(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let (mut src, _) = buffer(&a, 1 << 14, Access::LOCAL_WRITE)?;
        let (dst, _) = buffer(&b, 1 << 14, Access::ALL)?;
        let (gone, gone_id) = buffer(&b, 1 << 14, Access::ALL)?;
        fill_pattern(&mut src, 5);
        let (ab, _ba) = connect(&a, &b)?;
        b.deregister(gone_id)?;
        let s = src.addr();
        let h = a.submit(
            ab,
            Batch::new()
                .write(s, dst.addr(), 4096)
                .write(s + 4096, gone.addr(), 4096)
                .write(s + 8192, dst.addr() + 8192, 4096)
                .notify(77),
        )?;
        let r = h.wait(secs(30));
        ensure!(r.is_err(), "a batch with a refused write succeeded");
        if let Some(n) = b.poll_notification(Instant::now() + Duration::from_millis(300)) {
            bail!(
                "tag {} surfaced for a batch with a refused write ({r:?})",
                n.tag
            );
        }
        if a.peer_alive(ab)? {
            a.submit(ab, Batch::new().write(s, dst.addr(), 4096).notify(78))?
                .wait(secs(30))?;
            let n = b
                .poll_notification(secs(10))
                .context("the good batch's tag")?;
            ensure!(n.tag == 78, "got tag {}", n.tag);
            ensure!(dst.read_vec(..4096) == src.read_vec(..4096));
        }
        Ok(())
    }

    /// A thread blocked posting a large batch (every window full, reaping on its own
    /// thread) must not hold up what other peers send meanwhile: a notification from a
    /// second peer reaches a thread that only blocks on the notification channel, without
    /// polling, before the large batch has been posted. Both transfers land exactly.
    pub fn blocked_poster_does_not_starve_others(kind: BackendKind) -> Result<()> {
        let a = engine_with(config(kind).tx_depth(16).signal_every(4).qps_per_peer(1))?;
        let (b, c) = (engine(kind)?, engine(kind)?);
        const OP: usize = 1024;
        let ops = (max_bytes() as usize / OP).min(8192);
        let (mut src, _) = buffer(&a, ops * OP, Access::LOCAL_WRITE)?;
        let (dst, _) = buffer(&b, ops * OP, Access::ALL)?;
        let (mut csrc, _) = buffer(&c, 4096, Access::LOCAL_WRITE)?;
        let (cdst, _) = buffer(&a, 4096, Access::ALL)?;
        let (ab, _) = connect(&a, &b)?;
        let (ca, ac) = connect(&c, &a)?;
        fill_pattern(&mut src, 41);
        fill_pattern(&mut csrc, 42);
        // Ops in reverse order: nothing coalesces, so there are `ops` work requests.
        let mut big = Batch::with_capacity(ops);
        for k in (0..ops).rev() {
            let off = (k * OP) as u64;
            big.push(TransferOp {
                op: Op::Write,
                local: src.addr() + off,
                remote: dst.addr() + off,
                len: OP as u64,
            });
        }
        let rx = a.notifications();
        let started = Instant::now();
        let big_done = std::thread::scope(|s| -> Result<Result<()>> {
            let poster = s.spawn(|| -> Result<(Duration, Result<()>)> {
                let h = a.submit(ab, big)?;
                let posted = started.elapsed();
                Ok((posted, h.wait(secs(120)).map(drop).map_err(Into::into)))
            });
            std::thread::sleep(Duration::from_millis(20));
            c.submit(
                ca,
                Batch::new()
                    .write(csrc.addr(), cdst.addr(), 4096)
                    .notify(77),
            )?
            .wait(secs(30))?;
            let sent = started.elapsed();
            let n = rx
                .recv_timeout(Duration::from_secs(60))
                .context("the second peer's notification never arrived")?;
            let got = started.elapsed();
            ensure!(n.peer == ac && n.tag == 77, "unexpected {n:?}");
            ensure!(
                cdst.to_vec() == csrc.to_vec(),
                "the second peer's bytes were not in place"
            );
            let (posted, done) = poster.join().expect("poster panicked")?;
            eprintln!(
                "blocked poster: tag sent {sent:?}, received {got:?}; big batch posted {posted:?}"
            );
            // Only meaningful while the poster was still blocked well after the tag.
            if posted > sent + Duration::from_millis(300) {
                ensure!(
                    got < posted,
                    "the tag (sent at {sent:?}) arrived at {got:?}, only after the blocked \
                     poster finished at {posted:?}"
                );
            }
            Ok(done)
        })?;
        big_done?;
        ensure!(
            dst.to_vec() == src.to_vec(),
            "the large batch's bytes differ"
        );
        Ok(())
    }

    /// Prepared batches: validated once, started many times. Every run sends what the
    /// source memory holds at that moment (zero copy), its notification carries the run's
    /// tag and finds the bytes in place; one run at a time; the local region stays pinned
    /// while the prepared batch lives; bad ranges fail at prepare; READs, READs with a
    /// notification and batches too large for one chain work through the ordinary path.
    pub fn prepared(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        const N: usize = 64 << 10;
        let (mut src, src_id) = buffer(&a, N, Access::LOCAL_WRITE)?;
        let (back, _) = buffer(&a, N, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, N + 8192, Access::ALL)?;
        let (ab, _ba) = connect(&a, &b)?;
        dst.fill(GUARD);
        let (s0, d0) = (src.addr(), dst.addr() + 4096);
        // Two ops, the second landing right after the first: one WR once coalesced.
        let mut p = a.prepare(
            ab,
            Batch::new()
                .write(s0, d0, 4096)
                .write(s0 + 4096, d0 + 4096, 4096)
                .notify(1)
                .timeout(Duration::from_secs(30)),
        )?;
        ensure!(p.bytes() == 8192);
        ensure!(
            p.is_fast_lane() == (kind == BackendKind::Verbs),
            "fast lane {} on {kind:?}",
            p.is_fast_lane()
        );
        for run in 0..20u32 {
            fill_pattern_at(&mut src, 0, 8192, 500 + u64::from(run));
            if run % 2 == 0 {
                p.start_tagged(100 + run)?;
            } else {
                p.start()?;
            }
            let again = p.start();
            ensure!(
                matches!(again, Err(Error::Unsupported { .. })),
                "a second start during a run: {again:?}"
            );
            p.wait(secs(30))
                .with_context(|| format!("prepared run {run}"))?;
            let n = b
                .poll_notification(secs(10))
                .with_context(|| format!("notification of run {run}"))?;
            let want = if run % 2 == 0 { 100 + run } else { 1 };
            ensure!(n.tag == want, "run {run}: tag {}, expected {want}", n.tag);
            check_landed(&dst, 4096, &src, 0, 8192)
                .with_context(|| format!("bytes of run {run} at its notification"))?;
        }
        ensure!(
            all_eq(&dst.read_vec(..4096), GUARD) && all_eq(&dst.read_vec(4096 + 8192..), GUARD)
        );
        ensure!(b.try_notification().is_none(), "an extra notification");
        // try_wait, and waiting with no run in flight.
        p.start()?;
        let t0 = Instant::now();
        let r = loop {
            if let Some(r) = p.try_wait() {
                break r;
            }
            ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "try_wait never finished"
            );
            std::thread::yield_now();
        };
        r?;
        b.poll_notification(secs(10))
            .context("try_wait run's tag")?;
        p.wait(Instant::now())?;
        // The source region is pinned while the prepared batch lives.
        let busy = a.deregister(src_id);
        ensure!(
            matches!(busy, Err(Error::RegionBusy { .. })),
            "deregistering a prepared batch's region: {busy:?}"
        );
        // A prepared READ (no notification), re-run after the remote side changed.
        let mut r = a.prepare(ab, Batch::new().read(back.addr(), d0, 8192))?;
        for run in 0..3u64 {
            fill_pattern_at(&mut dst, 4096, 8192, 900 + run);
            r.start()?;
            r.wait(secs(30))?;
            ensure!(
                back.read_vec(..8192) == dst.read_vec(4096..4096 + 8192),
                "read run {run}: wrong bytes"
            );
        }
        // A READ then a notification: never one chain on verbs (RC does not order the tag
        // after the read responses), and still correct.
        let mut rn = a.prepare(ab, Batch::new().read(back.addr(), d0, 4096).notify(7))?;
        ensure!(
            !rn.is_fast_lane(),
            "READ + notification took the one-chain lane"
        );
        rn.start()?;
        rn.wait(secs(30))?;
        ensure!(b.poll_notification(secs(10)).context("READ's tag")?.tag == 7);
        // Too many WRs for one chain: 200 scattered 32 B writes (nothing coalesces).
        let mut big = Batch::with_capacity(200);
        for i in 0..200u64 {
            big.push(TransferOp {
                op: Op::Write,
                local: src.addr() + i * 128,
                remote: d0 + i * 40,
                len: 32,
            });
        }
        fill_pattern(&mut src, 77);
        let mut bp = a.prepare(ab, big)?;
        ensure!(!bp.is_fast_lane(), "200 WRs took the one-chain lane");
        bp.start()?;
        bp.wait(secs(30))?;
        for i in 0..200usize {
            let (d, s) = (4096 + i * 40, i * 128);
            ensure!(
                dst.read_vec(d..d + 32) == src.read_vec(s..s + 32),
                "scattered write {i}: wrong bytes"
            );
        }
        // Validation happens at prepare.
        let oob = a.prepare(
            ab,
            Batch::new().write(s0, dst.addr() + (N + 8192) as u64, 8),
        );
        ensure!(
            matches!(oob, Err(Error::RemoteOutOfBounds { .. })),
            "out-of-bounds remote: {oob:?}"
        );
        let abs = a.prepare(ab, Batch::new().write(s0, d0, 8).deadline(secs(5)));
        ensure!(
            matches!(abs, Err(Error::Unsupported { .. })),
            "absolute deadline: {abs:?}"
        );
        // Dropping the prepared batches unpins the source region.
        drop((p, r, rn, bp));
        // (A backend may still hold the last run's state for a moment.)
        a.deregister_wait(src_id, secs(10))
            .context("deregister after the prepared batches are gone")?;
        Ok(())
    }

    pub fn concurrency(kind: BackendKind) -> Result<()> {
        let b = engine(kind)?;
        const SENDERS: usize = 3;
        const BATCHES: usize = 24;
        const OPS: usize = 4;
        const OP: usize = 16 << 10;
        let per_sender = BATCHES * OPS * OP;
        let (mut dst, _) = buffer(&b, SENDERS * per_sender, Access::ALL)?;
        dst.fill(GUARD);
        let dst_addr = dst.addr();
        let mut threads = Vec::new();
        let mut peers = Vec::new();
        let mut srcs = Vec::new();
        for s in 0..SENDERS {
            let a = engine(kind)?;
            let (mut src, _) = buffer(&a, per_sender, Access::LOCAL_WRITE)?;
            fill_pattern(&mut src, 100 + s as u64);
            let (ab, ba) = connect(&a, &b)?;
            peers.push(ba);
            let src_addr = src.addr();
            srcs.push(src);
            threads.push(std::thread::spawn(move || -> Result<()> {
                let base = dst_addr + (s * per_sender) as u64;
                let mut handles = Vec::new();
                for k in 0..BATCHES {
                    let mut batch = Batch::with_capacity(OPS);
                    for o in 0..OPS {
                        // Reverse op order inside the batch so completion order varies.
                        let off = ((k * OPS + (OPS - 1 - o)) * OP) as u64;
                        batch.push(TransferOp {
                            op: Op::Write,
                            local: src_addr + off,
                            remote: base + off,
                            len: OP as u64,
                        });
                    }
                    handles.push(a.submit(ab, batch.notify(k as u32))?);
                }
                for h in handles {
                    h.wait(secs(60))?;
                }
                // Keep the engine alive until the receiver has seen everything.
                std::thread::sleep(Duration::from_millis(200));
                drop(a);
                Ok(())
            }));
        }
        let mut seen = HashSet::new();
        while seen.len() < SENDERS * BATCHES {
            let n = b
                .poll_notification(secs(60))
                .with_context(|| format!("only {} notifications", seen.len()))?;
            ensure!(
                peers.contains(&n.peer),
                "notification from unknown {}",
                n.peer
            );
            ensure!((n.tag as usize) < BATCHES, "bad tag {}", n.tag);
            ensure!(seen.insert((n.peer, n.tag)), "duplicate notification {n:?}");
        }
        for t in threads {
            t.join().expect("sender thread panicked")?;
        }
        for (s, src) in srcs.iter().enumerate() {
            let d = dst.read_vec(s * per_sender..(s + 1) * per_sender);
            ensure!(d == src.to_vec(), "sender {s}: bytes differ");
        }
        Ok(())
    }

    /// Cancel a large batch right after submitting it: it ends `Cancelled` (or `Done` if
    /// it won the race), its regions are released, and the connection stays usable.
    pub fn cancellation(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let n = max_bytes().min(32 << 20) as usize;
        let (mut src, src_id) = buffer(&a, n, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, n, Access::ALL)?;
        fill_pattern(&mut src, 5);
        let (ab, _) = connect(&a, &b)?;
        let chunk = 64 << 10;
        let batch: Batch = (0..n / chunk)
            .map(|i| TransferOp {
                op: Op::Write,
                local: src.addr() + (i * chunk) as u64,
                remote: dst.addr() + (i * chunk) as u64,
                len: chunk as u64,
            })
            .collect();
        let h = a.submit(ab, batch)?;
        let cancelled = h.cancel();
        match (cancelled, h.status()) {
            (true, BatchStatus::Cancelled) => {
                ensure!(matches!(h.wait(secs(1)), Err(Error::Cancelled)));
            }
            (false, BatchStatus::Done) => eprintln!("note: batch finished before cancel"),
            other => bail!("unexpected cancel outcome {other:?}"),
        }
        ensure!(!h.cancel(), "second cancel must report finished");
        // The backend lets go of the batch soon: the source region can be deregistered.
        a.deregister_wait(src_id, secs(30))
            .context("region still busy after cancel")?;
        // The connection is still good.
        let (mut s2, _) = buffer(&a, 4096, Access::LOCAL_WRITE)?;
        fill_pattern(&mut s2, 9);
        dst.fill_range(..4096, GUARD);
        a.submit(ab, Batch::new().write(s2.addr(), dst.addr(), 4096))?
            .wait(secs(30))?;
        ensure!(dst.read_vec(..4096) == s2.to_vec(), "transfer after cancel");
        Ok(())
    }

    /// Batch deadlines fail the batch with `Timeout`; a short `wait` deadline does not.
    pub fn deadlines(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let n = max_bytes().min(16 << 20);
        let (src, src_id) = buffer(&a, n as usize, Access::LOCAL_WRITE)?;
        let (dst, _) = buffer(&b, n as usize, Access::ALL)?;
        let (ab, _) = connect(&a, &b)?;
        // Deadline already passed: must fail with Timeout, promptly.
        let t0 = Instant::now();
        let h = a.submit(
            ab,
            Batch::new()
                .write(src.addr(), dst.addr(), n)
                .deadline(Instant::now()),
        )?;
        match h.wait(secs(10)) {
            Err(Error::Timeout { .. }) => {}
            other => bail!("expired batch: {other:?}"),
        }
        ensure!(matches!(
            h.status(),
            BatchStatus::Failed(Error::Timeout { .. })
        ));
        ensure!(
            t0.elapsed() < Duration::from_secs(5),
            "timeout took {:?}",
            t0.elapsed()
        );
        // A small batch whose deadline passed before it was submitted fails the same way
        // and nothing of it is posted (its bytes never land), whatever the window.
        let mut dst = dst;
        dst.fill_range(..64, GUARD);
        let h = a.submit(
            ab,
            Batch::new()
                .write(src.addr(), dst.addr(), 64)
                .deadline(Instant::now()),
        )?;
        let got = h.wait(secs(10));
        ensure!(
            matches!(got, Err(Error::Timeout { .. })),
            "expired small batch: {got:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
        ensure!(
            all_eq(&dst.read_vec(..64), GUARD),
            "an expired batch was posted anyway"
        );
        // A wait deadline that passes first returns Timeout but the batch carries on.
        let h = a.submit(ab, Batch::new().write(src.addr(), dst.addr(), n))?;
        match h.wait(Instant::now()) {
            Ok(_) => eprintln!("note: batch finished within a zero wait"),
            Err(Error::Timeout { .. }) => {}
            Err(e) => bail!("zero wait: {e}"),
        }
        h.wait(secs(60)).context("batch after a short wait")?;
        a.deregister_wait(src_id, secs(30))?;
        Ok(())
    }

    /// The peer shuts down in the middle of a large batch: the batch fails within its
    /// deadline, later submits fail, and nothing outside the target range was written.
    pub fn peer_dies_mid_batch(kind: BackendKind) -> Result<()> {
        let a = engine(kind)?;
        let b = engine(kind)?;
        let n = max_bytes().min(64 << 20) as usize;
        let (mut src, _) = buffer(&a, n, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, n + 2 * 4096, Access::ALL)?;
        fill_pattern(&mut src, 3);
        dst.fill(GUARD);
        let (ab, _) = connect(&a, &b)?;
        let chunk = 256 << 10;
        let target = dst.addr() + 4096;
        let mk = || chunked_writes(src.addr(), target, n, chunk);
        let killer = {
            let b = b.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                b.shutdown();
            })
        };
        let t0 = Instant::now();
        let mut failed = None;
        // Keep the link busy until the peer is gone.
        for _ in 0..200 {
            let h = match a.submit(ab, mk()) {
                Ok(h) => h,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            if let Err(e) = h.wait(secs(25)) {
                failed = Some(e);
                break;
            }
        }
        killer.join().expect("killer");
        let e = failed.context("the peer shut down but every batch succeeded")?;
        ensure!(
            matches!(
                e,
                Error::PeerGone { .. }
                    | Error::Remote { .. }
                    | Error::Timeout { .. }
                    | Error::Completion { .. }
            ),
            "unexpected error {e:?}"
        );
        ensure!(
            t0.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t0.elapsed()
        );
        // Bytes may be partial inside the target, never outside it.
        ensure!(
            all_eq(&dst.read_vec(..4096), GUARD),
            "guard before target overwritten"
        );
        ensure!(
            all_eq(&dst.read_vec(4096 + n..), GUARD),
            "guard after target overwritten"
        );
        // A later submit fails quickly (or its batch does).
        let t1 = Instant::now();
        if let Ok(h) = a.submit(ab, Batch::new().write(src.addr(), target, 4096)) {
            ensure!(h.wait(secs(25)).is_err(), "write to a dead peer succeeded");
        }
        ensure!(t1.elapsed() < Duration::from_secs(25));
        ensure!(!a.peer_alive(ab)?, "a dead peer is reported alive");
        Ok(())
    }

    /// Bounds and permission checks: every bad op is refused with a typed error before
    /// anything is posted (a good op in the same batch does not run either).
    pub fn permissions(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let (src, _) = buffer(&a, 1 << 16, Access::LOCAL_WRITE)?;
        let (nolw, _) = buffer(&a, 4096, Access::NONE)?;
        let (exp, _) = buffer(&b, 1 << 16, Access::ALL)?;
        let (ro, _) = buffer(&b, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        let (hidden, _) = buffer(&b, 4096, Access::LOCAL_WRITE)?;
        let (ab, _) = connect(&a, &b)?;
        let exposed = a.peer_regions(ab)?;
        ensure!(
            !exposed
                .iter()
                .any(|r| r.addr <= hidden.addr() && hidden.addr() < r.addr + r.len),
            "a LOCAL_WRITE-only region was exposed"
        );
        let unregistered = vec![0u8; 4096];
        let (e_end, s) = (exp.addr() + exp.len() as u64, src.addr());
        type Case = (&'static str, Batch, fn(&Error) -> bool);
        let cases: Vec<Case> = vec![
            (
                "remote past end",
                Batch::new().write(s, e_end - 10, 20),
                |e| matches!(e, Error::RemoteOutOfBounds { .. }),
            ),
            (
                "remote not exposed",
                Batch::new().write(s, hidden.addr(), 16),
                |e| matches!(e, Error::RemoteOutOfBounds { .. }),
            ),
            (
                "write to read-only",
                Batch::new().write(s, ro.addr(), 16),
                |e| matches!(e, Error::RemotePermission { needed, .. } if *needed == Access::REMOTE_WRITE),
            ),
            (
                "unregistered local",
                Batch::new().write(unregistered.as_ptr() as u64, exp.addr(), 16),
                |e| matches!(e, Error::Unregistered { .. }),
            ),
            (
                "local past end",
                Batch::new().write(s + (1 << 16) - 8, exp.addr(), 16),
                |e| matches!(e, Error::Unregistered { .. }),
            ),
            (
                "read into non-writable local",
                Batch::new().read(nolw.addr(), exp.addr(), 16),
                |e| matches!(e, Error::PermissionDenied { .. }),
            ),
            ("zero length", Batch::new().write(s, exp.addr(), 0), |e| {
                matches!(e, Error::InvalidRange { .. })
            }),
            (
                "remote overflow",
                Batch::new().write(s, u64::MAX - 4, 16),
                |e| matches!(e, Error::InvalidRange { .. }),
            ),
            ("empty batch", Batch::new(), |e| {
                matches!(e, Error::EmptyBatch)
            }),
            (
                "good op then bad op",
                Batch::new()
                    .write(s, exp.addr(), 4096)
                    .write(s, e_end - 1, 2),
                |e| matches!(e, Error::RemoteOutOfBounds { .. }),
            ),
        ];
        for (name, batch, ok) in cases {
            match a.submit(ab, batch) {
                Ok(_) => bail!("{name}: accepted"),
                Err(e) if ok(&e) => {}
                Err(e) => bail!("{name}: wrong error {e:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        ensure!(
            all_eq(&exp.to_vec(), 0),
            "a refused batch wrote into the peer"
        );
        // Positive controls: reading a read-only region works, and so does a good write.
        a.submit(ab, Batch::new().read(src.addr(), ro.addr(), 4096))?
            .wait(secs(30))?;
        a.submit(ab, Batch::new().write(s, exp.addr(), 4096))?
            .wait(secs(30))?;
        ensure!(exp.read_vec(..4096) == src.read_vec(..4096));
        // A disconnected peer is unknown.
        a.disconnect(ab)?;
        ensure!(matches!(
            a.submit(ab, Batch::new().write(s, exp.addr(), 1)),
            Err(Error::UnknownPeer { .. })
        ));
        Ok(())
    }

    /// Registration rules: same range again is free, busy regions refuse deregistration,
    /// and regions split into several MRs still move bytes across the MR boundaries.
    pub fn registration_and_mr_split(kind: BackendKind) -> Result<()> {
        let cfg = || config(kind).max_mr_bytes(1 << 20);
        let (a, b) = (engine_with(cfg())?, engine_with(cfg())?);
        let n = 4 << 20;
        let (mut src, sid) = buffer(&a, n, Access::LOCAL_WRITE)?;
        ensure!(
            a.register(&src, Access::LOCAL_WRITE)? == sid,
            "re-registration not free"
        );
        a.deregister(sid)?; // drops the second registration only
        ensure!(
            a.regions().iter().any(|r| r.id == sid && r.mrs == 4),
            "{:?}",
            a.regions()
        );
        let (mut dst, _) = buffer(&b, n + 8192, Access::ALL)?;
        ensure!(b.exposed_regions().len() == 5, "{:?}", b.exposed_regions());
        fill_pattern(&mut src, 11);
        dst.fill(GUARD);
        let (ab, _) = connect(&a, &b)?;
        // 3 MiB + 5 starting mid-MR on both sides, crossing several MR boundaries.
        let (soff, doff, len) = (512 << 10, (1 << 20) - 77, (3 << 20) + 5);
        let h = a.submit(
            ab,
            Batch::new().write(
                src.addr() + soff as u64,
                dst.addr() + doff as u64,
                len as u64,
            ),
        )?;
        // A backend may finish inside `submit` (rxe moves the data within the post call),
        // or between `submit` and here. Backends finish a batch before they release it
        // (and its pins), so a successful deregistration is only wrong if the batch is
        // still unfinished afterwards.
        let deregistered = match a.deregister(sid) {
            Err(Error::RegionBusy { .. }) => false,
            Ok(()) if h.status().is_finished() => true,
            Ok(()) => bail!("deregistered a region under an in-flight batch"),
            Err(e) if h.status().is_finished() => {
                bail!("unexpected deregister error {e:?}")
            }
            Err(e) => bail!("deregister: {e:?}"),
        };
        h.wait(secs(60))?;
        check_landed(&dst, doff, &src, soff, len)?;
        if !deregistered {
            a.deregister_wait(sid, secs(30))?;
        }
        ensure!(a.regions().is_empty());
        ensure!(matches!(
            a.deregister(sid),
            Err(Error::UnknownRegion { .. })
        ));
        Ok(())
    }

    /// A peer that registers more memory after connecting is re-described.
    pub fn redescribe(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let (mut src, _) = buffer(&a, 8192, Access::LOCAL_WRITE)?;
        fill_pattern(&mut src, 21);
        let (ab, _) = connect(&a, &b)?;
        ensure!(a.peer_regions(ab)?.is_empty());
        let (late, _) = buffer(&b, 8192, Access::ALL)?;
        ensure!(matches!(
            a.submit(ab, Batch::new().write(src.addr(), late.addr(), 8192)),
            Err(Error::RemoteOutOfBounds { .. })
        ));
        let regions = a.redescribe(ab)?;
        ensure!(
            regions.len() == 1 && regions[0].addr == late.addr(),
            "{regions:?}"
        );
        a.submit(ab, Batch::new().write(src.addr(), late.addr(), 8192))?
            .wait(secs(30))?;
        ensure!(late.to_vec() == src.to_vec());
        Ok(())
    }

    /// When `connect` returns, the listener has published the peer too: it is in
    /// `peers()` and a `Describe` on its session (`redescribe`) is served at once. (The
    /// listener used to publish after the initiator returned, so an immediate `redescribe`
    /// could be refused as "unknown session".)
    pub fn known_on_both_sides_when_connect_returns(kind: BackendKind) -> Result<()> {
        let (a, b) = (engine(kind)?, engine(kind)?);
        let (_late, _) = buffer(&b, 4096, Access::ALL)?;
        for i in 0..20 {
            let ab = a.connect(b.local_addr())?;
            ensure!(b.peers().len() == i + 1, "round {i}: the listener lags");
            let regions = a.redescribe(ab)?;
            ensure!(regions.len() == 1, "round {i}: {regions:?}");
        }
        Ok(())
    }

    /// Hostile bytes on the control port: each connection is dropped, the listener keeps
    /// serving, and a valid engine still connects while half-open clients hang around.
    pub fn hostile_handshakes(kind: BackendKind) -> Result<()> {
        let b = engine_with(config(kind).handshake_timeout(Duration::from_secs(2)))?;
        let (dst, _) = buffer(&b, 4096, Access::ALL)?;
        let addr = b.local_addr();
        let send = |bytes: &[u8]| -> Result<TcpStream> {
            let mut s = TcpStream::connect(addr)?;
            s.write_all(bytes)?;
            Ok(s)
        };
        let mut held = Vec::new();
        // Half-open: connect, say nothing, keep the socket.
        held.push(TcpStream::connect(addr)?);
        // Partial header, kept open.
        held.push(send(b"PGWR\x01")?);
        // Garbage, HTTP and TLS probes.
        let garbage = pattern(4096, 99);
        drop(send(&garbage)?);
        drop(send(b"GET / HTTP/1.1\r\nHost: pagewire\r\n\r\n")?);
        drop(send(&[
            0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03, 0,
        ])?);
        // Valid magic, oversized length.
        let mut h = Vec::new();
        h.extend_from_slice(b"PGWR");
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&[1, 0]);
        h.extend_from_slice(&u32::MAX.to_le_bytes());
        drop(send(&h)?);
        // Foreign version.
        let mut v = h.clone();
        v[4] = 77;
        v[8..12].copy_from_slice(&0u32.to_le_bytes());
        drop(send(&v)?);
        // A Hello with a hostile body (random bytes of the announced length).
        let mut hb = h.clone();
        hb[8..12].copy_from_slice(&512u32.to_le_bytes());
        hb.extend_from_slice(&garbage[..512]);
        drop(send(&hb)?);
        // A Hello announcing more bytes than it sends, then hanging.
        let mut trunc = h.clone();
        trunc[8..12].copy_from_slice(&100u32.to_le_bytes());
        trunc.extend_from_slice(&[0; 10]);
        held.push(send(&trunc)?);
        // A well-formed Ready out of turn gets dropped too.
        let mut ready = h.clone();
        ready[6] = 3;
        ready[8..12].copy_from_slice(&0u32.to_le_bytes());
        drop(send(&ready)?);

        // A valid client connects while the half-open ones are still held.
        let a = engine(kind)?;
        let (mut src, _) = buffer(&a, 4096, Access::LOCAL_WRITE)?;
        fill_pattern(&mut src, 4);
        let t0 = Instant::now();
        let (ab, _) = connect(&a, &b)?;
        ensure!(
            t0.elapsed() < Duration::from_secs(2),
            "valid connect took {:?}",
            t0.elapsed()
        );
        a.submit(
            ab,
            Batch::new().write(src.addr(), dst.addr(), 4096).notify(5),
        )?
        .wait(secs(30))?;
        ensure!(b.poll_notification(secs(10)).is_some_and(|n| n.tag == 5));
        ensure!(dst.to_vec() == src.to_vec());
        ensure!(
            b.peers().len() == 1,
            "hostile clients became peers: {:?}",
            b.peers()
        );
        // Half-open clients are cut at the handshake timeout.
        let mut s = held.remove(0);
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut buf = [0u8; 16];
        let r = s.read(&mut buf);
        ensure!(
            matches!(r, Ok(0) | Err(_)),
            "half-open client not dropped: {r:?}"
        );
        Ok(())
    }

    /// A flood of half-open control connections from one host is capped (16 per source
    /// IP): the excess is closed at once, and once the flood goes away a valid client
    /// connects.
    pub fn handshake_flood(kind: BackendKind) -> Result<()> {
        let b = engine_with(config(kind).handshake_timeout(Duration::from_secs(5)))?;
        let addr = b.local_addr();
        let mut flood = Vec::new();
        for _ in 0..24 {
            flood.push(TcpStream::connect(addr)?);
        }
        let mut refused = 0;
        for s in &mut flood {
            s.set_read_timeout(Some(Duration::from_millis(100)))?;
            match s.read(&mut [0u8; 8]) {
                Ok(0) => refused += 1,
                Err(e)
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    refused += 1
                }
                _ => {}
            }
        }
        ensure!(
            refused == 8,
            "{refused} of 24 half-open connections were closed at once"
        );
        drop(flood);
        let a = engine(kind)?;
        let t0 = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match a.connect(addr) {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("retrying after {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => bail!("valid client refused after the flood: {e}"),
            }
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(2),
            "took {:?}",
            t0.elapsed()
        );
        Ok(())
    }

    /// One batch of `many_ops()` (>= 200,000 by default) small scattered ops from a real
    /// plan: MiMo-like asymmetric MHA in bf16 (head_dim 192, v_head_dim 32, so 384 B K and
    /// 64 B V pieces), page_first -> page_head, every page moved to another. Far more ops
    /// than any queue, window or gather of a backend; WRITE with a notification, then READ
    /// back, byte-exact on the receiver with an untouched spare page as guard.
    pub fn many_small_ops(kind: BackendKind) -> Result<()> {
        let cfg = || config(kind).batch_timeout(Duration::from_secs(300));
        let (a, b) = (engine_with(cfg())?, engine_with(cfg())?);
        // 4 layers x 16 tokens x 8 heads x (K, V) = 1024 ops a page; nothing coalesces.
        let (layers, page_size, heads) = (4u64, 16u64, 8u64);
        let pages = many_ops().div_ceil(layers * page_size * heads * 2).max(2);
        let geometry = PoolGeometry::builder(PoolKind::MhaSplit)
            .layers(layers)
            .page_size(page_size)
            .heads(heads)
            .head_dim(192)
            .v_head_dim(32)
            .dtype_bytes(2)
            .capacity((pages + 1) * page_size) // page 0 of the destination stays spare
            .build()?;
        let k_bytes = geometry.buffer_bytes(pagewire_layout::Component::K);
        let pool_bytes = (k_bytes + geometry.buffer_bytes(pagewire_layout::Component::V)) as usize;
        let place = |layout, base: u64| Pool::new(geometry, layout, base, Some(base + k_bytes));
        let (mut src, _) = buffer(&a, pool_bytes, Access::LOCAL_WRITE)?;
        let (mut dst, _) = buffer(&b, pool_bytes, Access::ALL)?;
        let (mut back, _) = buffer(&a, pool_bytes, Access::LOCAL_WRITE)?;
        fill_pattern(&mut src, 11);
        dst.fill(GUARD);
        back.fill(GUARD);
        let src_pool = place(Layout::PageFirst, src.addr())?;
        let dst_pool = place(Layout::PageHead, dst.addr())?;
        let src_pages: Vec<u64> = (0..pages).collect();
        let dst_pages: Vec<u64> = (1..=pages).rev().collect();
        let plan = pagewire_layout::plan(&src_pool, &dst_pool, &src_pages, &dst_pages)?;
        ensure!(
            plan.len() as u64 >= many_ops(),
            "plan has {} ops, wanted {}",
            plan.len(),
            many_ops()
        );
        ensure!(plan.iter().all(|t| t.len == 384 || t.len == 64));
        let (ab, ba) = connect(&a, &b)?;

        let h = a.submit_plan(ab, Op::Write, &plan, Some(77))?;
        let note = b
            .poll_notification(secs(300))
            .context("no notification for the batch")?;
        ensure!(note.peer == ba && note.tag == 77, "notification {note:?}");
        let st = h.wait(secs(300)).context("WRITE batch")?;
        ensure!(
            st.bytes == plan.iter().map(|t| t.len).sum::<u64>(),
            "{st:?}"
        );
        let mut expect = vec![GUARD; pool_bytes];
        for t in &plan {
            let (s, d, n) = (t.src - src.addr(), t.dst - dst.addr(), t.len);
            let (s, d, n) = (s as usize, d as usize, n as usize);
            expect[d..d + n].copy_from_slice(&src.read_vec(s..s + n));
        }
        let got = dst.to_vec();
        if got != expect {
            let first = (0..pool_bytes).find(|&i| got[i] != expect[i]).unwrap_or(0);
            bail!("WRITE: destination pool differs from the plan, first at byte {first}");
        }

        let back_pool = place(Layout::PageFirst, back.addr())?;
        let pull = pagewire_layout::plan(&dst_pool, &back_pool, &dst_pages, &src_pages)?;
        ensure!(pull.len() == plan.len(), "READ plan of {} ops", pull.len());
        a.submit_plan(ab, Op::Read, &pull, None)?
            .wait(secs(300))
            .context("READ batch")?;
        expect.fill(GUARD);
        for t in &plan {
            let (s, n) = ((t.src - src.addr()) as usize, t.len as usize);
            expect[s..s + n].copy_from_slice(&src.read_vec(s..s + n));
        }
        let got = back.to_vec();
        if got != expect {
            let first = (0..pool_bytes).find(|&i| got[i] != expect[i]).unwrap_or(0);
            bail!("READ: pulled pool differs from the source, first at byte {first}");
        }
        Ok(())
    }

    /// Shared tokens: a wrong token is rejected with a typed error, the right one works;
    /// engines of different backends refuse each other.
    pub fn tokens_and_mismatch(kind: BackendKind) -> Result<()> {
        let b = engine_with(config(kind).token("sesame"))?;
        let wrong = engine_with(config(kind).token("guess"))?;
        match wrong.connect(b.local_addr()) {
            Err(Error::Handshake(HandshakeError::Rejected { reason })) => {
                ensure!(reason.contains("token"), "{reason}");
            }
            other => bail!("wrong token: {other:?}"),
        }
        let none = engine(kind)?;
        ensure!(
            none.connect(b.local_addr()).is_err(),
            "missing token accepted"
        );
        let right = engine_with(config(kind).token("sesame"))?;
        connect(&right, &b)?;
        let other_kind = if kind == BackendKind::Tcp {
            BackendKind::Loopback
        } else {
            BackendKind::Tcp
        };
        let other = engine_with(config(other_kind).token("sesame"))?;
        match other.connect(b.local_addr()) {
            Err(Error::Handshake(_)) => {}
            r => bail!("backend mismatch: {r:?}"),
        }
        ensure!(b.peers().len() == 1);
        Ok(())
    }
}

macro_rules! backend_suite {
    ($name:ident, $kind:expr, $progress:expr, $attrs:tt, [$($test:ident),* $(,)?]) => {
        mod $name {
            use super::*;
            $(suite_test!($attrs, $name, $kind, $progress, $test);)*
        }
    };
}

/// One test of a backend suite, with the suite's attributes (`[#[ignore = ".."]]` or `[]`).
macro_rules! suite_test {
    ([$(#[$m:meta])*], $name:ident, $kind:expr, $progress:expr, $test:ident) => {
        #[test]
        $(#[$m])*
        fn $test() {
            common::PROGRESS.set($progress);
            common::require($kind, stringify!($test));
            let t0 = Instant::now();
            suite::$test($kind).unwrap();
            eprintln!("{}::{} took {:?}", stringify!($name), stringify!($test), t0.elapsed());
        }
    };
}

/// The suite's tests in which every engine that must make progress is inside a call, so
/// they hold under manual progress too, plus `$extra`. Left out of the manual run: tests
/// in which a sender submits and then only the receiver is inside a call
/// (`write_read_sizes`, `notifications_in_order`, `many_small_ops`: a notification that
/// must follow data on other QPs is posted once that data's completions are reaped, by a
/// call on the sender's engine), and the handshake tests, which reap nothing.
macro_rules! caller_driven_suite {
    ($name:ident, $kind:expr, $progress:expr, $attrs:tt $(, $extra:ident)* $(,)?) => {
        backend_suite!($name, $kind, $progress, $attrs, [
            layout_plan_pages,
            notify_only,
            blocked_poster_does_not_starve_others,
            prepared,
            concurrency,
            cancellation,
            deadlines,
            peer_dies_mid_batch,
            permissions,
            registration_and_mr_split,
            redescribe,
            $($extra),*
        ]);
    };
}

macro_rules! all_backends {
    ($($name:ident => $kind:expr, $attrs:tt),* $(,)?) => {
        $(
            caller_driven_suite!(
                $name,
                $kind,
                pagewire_transport::ProgressMode::Auto,
                $attrs,
                write_read_sizes,
                notifications_in_order,
                refused_write_is_not_notified,
                many_small_ops,
                hostile_handshakes,
                handshake_flood,
                known_on_both_sides_when_connect_returns,
                tokens_and_mismatch,
            );
        )*
    };
}

all_backends!(loopback => BackendKind::Loopback, [], tcp => BackendKind::Tcp, []);
// Verbs needs a device: reported as ignored on a host, run for real in the soft-RoCE VM
// (`scripts/rdma-vm.sh test`, which passes --include-ignored).
#[cfg(feature = "verbs")]
all_backends!(verbs => BackendKind::Verbs, [#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]]);

// Verbs again with manual progress (no completion thread).
#[cfg(feature = "verbs")]
caller_driven_suite!(
    verbs_manual,
    BackendKind::Verbs,
    pagewire_transport::ProgressMode::Manual,
    [#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]],
);

/// TCP only: a peer *process* killed in the middle of a batch (re-executes this test
/// binary in the peer role).
#[test]
fn tcp_peer_process_killed_mid_batch() {
    peer_process_killed().unwrap();
}

const ROLE_ENV: &str = "PAGEWIRE_TEST_ROLE";

/// The peer role: only active in the child process.
#[test]
fn peer_role_helper() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("tcp-peer") {
        return;
    }
    let e = engine(BackendKind::Tcp).expect("engine");
    let (buf, _) = buffer(
        &e,
        max_bytes().clamp(4 << 20, 64 << 20) as usize,
        Access::ALL,
    )
    .expect("buffer");
    println!("LISTEN {} {:#x}", e.local_addr(), buf.addr());
    std::io::stdout().flush().ok();
    // Serve until killed (bounded, so an orphan cannot live forever).
    std::thread::sleep(Duration::from_secs(120));
}

fn peer_process_killed() -> Result<()> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "peer_role_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "tcp-peer")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (addr, base) = loop {
        let line = lines.next().context("child exited before listening")??;
        // libtest prints "test peer_role_helper ... " on the same line first.
        if let Some(rest) = line.split("LISTEN ").nth(1) {
            let mut it = rest.split_whitespace();
            let addr: std::net::SocketAddr = it.next().context("addr")?.parse()?;
            let base =
                u64::from_str_radix(it.next().context("base")?.trim_start_matches("0x"), 16)?;
            break (addr, base);
        }
    };
    let a = engine(BackendKind::Tcp)?;
    let n = max_bytes().clamp(4 << 20, 64 << 20) as usize;
    let (mut src, _) = buffer(&a, n, Access::LOCAL_WRITE)?;
    fill_pattern(&mut src, 8);
    let peer = a.connect(addr)?;
    let chunk = 1 << 20;
    let mk = || chunked_writes(src.addr(), base, n, chunk);
    // One good round first: the child is really serving.
    a.submit(peer, mk())?.wait(secs(30))?;
    let h = a.submit(peer, mk())?;
    child.kill()?;
    let t0 = Instant::now();
    let mut result = h.wait(secs(25));
    while result.is_ok() {
        result = a.submit(peer, mk()).and_then(|h| h.wait(secs(25)));
    }
    let _ = child.wait();
    let e = result.expect_err("loop exits on error");
    ensure!(
        matches!(e, Error::PeerGone { .. } | Error::Timeout { .. }),
        "unexpected error {e:?}"
    );
    ensure!(
        t0.elapsed() < Duration::from_secs(25),
        "took {:?}",
        t0.elapsed()
    );
    ensure!(
        matches!(
            a.submit(peer, Batch::new().write(src.addr(), base, 1)),
            Err(Error::PeerGone { .. })
        ),
        "submit after death must fail fast"
    );
    Ok(())
}

/// TCP only: hostile bytes on the *data* port. A stream with a wrong session is refused;
/// with the right session, requests outside the exposed memory or with a wrong key are
/// refused without touching memory, a malformed header drops the stream, and the real
/// connection keeps working.
#[test]
fn tcp_hostile_data_streams() {
    hostile_data_streams().unwrap();
}

fn hostile_data_streams() -> Result<()> {
    use pagewire_transport::EndpointInfo;
    let (a, b) = (engine(BackendKind::Tcp)?, engine(BackendKind::Tcp)?);
    let (mut src, _) = buffer(&a, 4096, Access::LOCAL_WRITE)?;
    fill_pattern(&mut src, 31);
    let (exp, _) = buffer(&b, 8192, Access::ALL)?;
    let (hidden, _) = buffer(&b, 4096, Access::LOCAL_WRITE)?;
    let (ab, _) = connect(&a, &b)?;
    let EndpointInfo::Tcp {
        data_port, session, ..
    } = a.peer_info(ab)?.remote_endpoint
    else {
        bail!("not a TCP endpoint");
    };
    let rkey = a.peer_regions(ab)?[0].rkey;
    let data = std::net::SocketAddr::from(([127, 0, 0, 1], data_port));
    let hello = |sid: u64| {
        let mut h = Vec::new();
        h.extend_from_slice(b"PGWS");
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&sid.to_le_bytes());
        h
    };
    let req = |kind: u8, rkey: u32, seq: u64, addr: u64, len: u64| {
        let mut r = vec![0u8; 40];
        r[0] = kind;
        r[4..8].copy_from_slice(&rkey.to_le_bytes());
        r[8..16].copy_from_slice(&seq.to_le_bytes());
        r[16..24].copy_from_slice(&addr.to_le_bytes());
        r[24..32].copy_from_slice(&len.to_le_bytes());
        r
    };
    // Closed = EOF or reset, not a read timeout.
    let closed = |s: &mut TcpStream| -> bool {
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        match s.read(&mut [0u8; 16]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    };
    // Garbage and a wrong session are dropped.
    let mut g = TcpStream::connect(data)?;
    g.write_all(b"GET / HTTP/1.1\r\n\r\n")?;
    ensure!(closed(&mut g), "garbage stream not dropped");
    let mut w = TcpStream::connect(data)?;
    w.write_all(&hello(session ^ 1))?;
    ensure!(closed(&mut w), "wrong session not dropped");
    // The right session: requests are validated one by one.
    let mut s = TcpStream::connect(data)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(&hello(session))?;
    let mut ok = [0u8; 4];
    s.read_exact(&mut ok)?;
    ensure!(&ok == b"OK\0\0");
    let status = |s: &mut TcpStream, r: Vec<u8>, payload: usize| -> Result<u32> {
        s.write_all(&r)?;
        s.write_all(&vec![0xAB; payload])?;
        let mut resp = [0u8; 16];
        s.read_exact(&mut resp)?;
        Ok(u32::from_le_bytes(resp[8..12].try_into()?))
    };
    ensure!(
        status(&mut s, req(1, rkey, 1, hidden.addr(), 16), 16)? == 1,
        "hidden write"
    );
    ensure!(
        status(&mut s, req(1, rkey ^ 0x55, 2, exp.addr(), 16), 16)? == 2,
        "bad key"
    );
    ensure!(
        status(&mut s, req(1, rkey, 3, exp.addr() + 8190, 16), 16)? == 1,
        "write across the end"
    );
    ensure!(
        status(&mut s, req(2, rkey, 4, hidden.addr(), 16), 0)? == 1,
        "hidden read"
    );
    // A burst (more-follows flag) of a refused WRITE and a NOTIFY flagged to ride in it:
    // both acks come at the burst's end, the NOTIFY's skipped (5), and no tag surfaces.
    let mut refused = req(1, rkey, 5, hidden.addr(), 16);
    refused[1] = 1;
    let mut in_burst = req(3, 0, 6, 0, 0);
    in_burst[2] = 1;
    in_burst[32..36].copy_from_slice(&99u32.to_le_bytes());
    s.write_all(&refused)?;
    s.write_all(&[0xAB; 16])?;
    s.write_all(&in_burst)?;
    let mut acks = [0u8; 32];
    s.read_exact(&mut acks)?;
    let st = |r: &[u8]| u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
    ensure!(
        (st(&acks[..16]), st(&acks[16..])) == (1, 5),
        "burst statuses {:?}",
        (st(&acks[..16]), st(&acks[16..]))
    );
    ensure!(
        b.try_notification().is_none(),
        "a skipped NOTIFY surfaced its tag"
    );
    // Malformed header: unknown kind, the in-burst flag on a WRITE, an absurd length.
    // Each drops the stream.
    s.write_all(&req(9, rkey, 7, exp.addr(), 16))?;
    ensure!(closed(&mut s), "unknown kind not dropped");
    let mut s1 = TcpStream::connect(data)?;
    s1.write_all(&hello(session))?;
    s1.read_exact(&mut ok)?;
    let mut flagged = req(1, rkey, 8, exp.addr(), 16);
    flagged[2] = 1;
    s1.write_all(&flagged)?;
    ensure!(closed(&mut s1), "in-burst flag on a WRITE not dropped");
    let mut s2 = TcpStream::connect(data)?;
    s2.write_all(&hello(session))?;
    s2.read_exact(&mut ok)?;
    s2.write_all(&req(1, rkey, 6, exp.addr(), u64::MAX))?;
    ensure!(closed(&mut s2), "absurd length not dropped");
    ensure!(
        all_eq(&exp.to_vec(), 0) && all_eq(&hidden.to_vec(), 0),
        "hostile requests wrote memory"
    );
    // The real connection is unaffected.
    a.submit(ab, Batch::new().write(src.addr(), exp.addr(), 4096))?
        .wait(secs(30))?;
    ensure!(exp.read_vec(..4096) == src.to_vec());
    Ok(())
}
