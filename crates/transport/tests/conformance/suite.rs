//! The conformance suite's tests that hold on every backend and on the simulated pair:
//! included by `tests/conformance.rs` (real engines, threads and the wall clock) and by
//! `tests/conformance_sim.rs` (the simulated world). Each includer provides `env`: the
//! engine factories and the clock the tests use (`now`, `elapsed`, `sleep`, `yield_now`,
//! `spawn`), so the same text runs in real time on real engines or in simulated time.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use pagewire_layout::{Layout, Pool, PoolGeometry, PoolKind};
use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Error, HandshakeError, Op, TransferOp,
};

use crate::env::*;

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
                let t0 = now();
                loop {
                    if let Some(n) = b.try_notification() {
                        break n;
                    }
                    ensure!(
                        elapsed(t0) < Duration::from_secs(30),
                        "notification {} never came",
                        got.len()
                    );
                    yield_now();
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
    if let Some(n) = b.poll_notification(now() + Duration::from_millis(300)) {
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
        p.is_fast_path() == (kind == BackendKind::Verbs),
        "fast path {} on {kind:?}",
        p.is_fast_path()
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
    ensure!(all_eq(&dst.read_vec(..4096), GUARD) && all_eq(&dst.read_vec(4096 + 8192..), GUARD));
    ensure!(b.try_notification().is_none(), "an extra notification");
    // try_wait, and waiting with no run in flight.
    p.start()?;
    let t0 = now();
    let r = loop {
        if let Some(r) = p.try_wait() {
            break r;
        }
        ensure!(
            elapsed(t0) < Duration::from_secs(30),
            "try_wait never finished"
        );
        yield_now();
    };
    r?;
    b.poll_notification(secs(10))
        .context("try_wait run's tag")?;
    p.wait(now())?;
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
        !rn.is_fast_path(),
        "READ + notification took the one-chain fast path"
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
    ensure!(!bp.is_fast_path(), "200 WRs took the one-chain fast path");
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
        threads.push(spawn(move || -> Result<()> {
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
            sleep(Duration::from_millis(200));
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
    let t0 = now();
    let h = a.submit(
        ab,
        Batch::new()
            .write(src.addr(), dst.addr(), n)
            .deadline(now()),
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
        elapsed(t0) < Duration::from_secs(5),
        "timeout took {:?}",
        elapsed(t0)
    );
    // A small batch whose deadline passed before it was submitted fails the same way
    // and nothing of it is posted (its bytes never land), whatever the window.
    let mut dst = dst;
    dst.fill_range(..64, GUARD);
    let h = a.submit(
        ab,
        Batch::new()
            .write(src.addr(), dst.addr(), 64)
            .deadline(now()),
    )?;
    let got = h.wait(secs(10));
    ensure!(
        matches!(got, Err(Error::Timeout { .. })),
        "expired small batch: {got:?}"
    );
    sleep(Duration::from_millis(50));
    ensure!(
        all_eq(&dst.read_vec(..64), GUARD),
        "an expired batch was posted anyway"
    );
    // A wait deadline that passes first returns Timeout but the batch carries on.
    let h = a.submit(ab, Batch::new().write(src.addr(), dst.addr(), n))?;
    match h.wait(now()) {
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
        spawn(move || {
            sleep(Duration::from_millis(2));
            b.shutdown();
        })
    };
    let t0 = now();
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
        elapsed(t0) < Duration::from_secs(30),
        "took {:?}",
        elapsed(t0)
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
    let t1 = now();
    if let Ok(h) = a.submit(ab, Batch::new().write(src.addr(), target, 4096)) {
        ensure!(h.wait(secs(25)).is_err(), "write to a dead peer succeeded");
    }
    ensure!(elapsed(t1) < Duration::from_secs(25));
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
    sleep(Duration::from_millis(50));
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
        Err(Error::Handshake(HandshakeError::TokenMismatch)) => {}
        other => bail!("wrong token: {other:?}"),
    }
    let none = engine(kind)?;
    match none.connect(b.local_addr()) {
        Err(Error::Handshake(HandshakeError::TokenMismatch)) => {}
        other => bail!("missing token: {other:?}"),
    }
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
