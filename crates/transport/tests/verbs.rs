//! Verbs-specific tests through the public API, on a real RDMA device (soft-RoCE `rxe0` in
//! the VM: `scripts/rdma-vm.sh test -p pagewire-transport`).
//!
//! The device tests are `#[ignore]`d with their reason, so a host's `cargo test` lists
//! them as ignored; the VM harness runs them with `--include-ignored` and the device in
//! `RDMA_DEVICE` (without it they fail: none passes without having run). The two-device
//! test also needs `RDMA_DEVICE2` (harness option `--two-devices`). The fallback tests at
//! the bottom run everywhere.
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Engine, EngineConfig, EngineConfigBuilder, Error,
    HostBuffer, ProgressMode,
};

mod common;
use common::secs;

/// The tests that take a rail's link down run alone: every other device test holds this
/// lock shared while it runs (a link going down under a test that did not expect it, or
/// two tests loading the emulated guest at once, made the failover tests flaky).
static LINKS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// `RDMA_DEVICE`, held with a shared hold on [`LINKS`] for as long as the test keeps it;
/// a test run without it fails.
struct Dev {
    name: String,
    _shared: std::sync::RwLockReadGuard<'static, ()>,
}

impl std::ops::Deref for Dev {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

fn device(test: &str) -> Dev {
    common::require(BackendKind::Verbs, test);
    Dev {
        name: std::env::var("RDMA_DEVICE").expect("require checked it"),
        _shared: LINKS.read().unwrap_or_else(|p| p.into_inner()),
    }
}

fn engine(dev: &str, f: impl FnOnce(EngineConfigBuilder) -> EngineConfigBuilder) -> Result<Engine> {
    let b = EngineConfig::builder()
        .backend(BackendKind::Verbs)
        .listen("127.0.0.1:0".parse()?)
        .rdma_device(dev)
        .batch_timeout(Duration::from_secs(60));
    let e = Engine::new(f(b).build()?)?;
    ensure!(
        e.backend_kind() == BackendKind::Verbs,
        "backend is {}",
        e.backend_kind()
    );
    Ok(e)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    pattern_at(0, n, seed)
}

/// Bytes `off..off + n` of the test pattern.
fn pattern_at(off: usize, n: usize, seed: u8) -> Vec<u8> {
    (off..off + n)
        .map(|i| (i as u8).wrapping_mul(151).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

fn filled(n: usize, seed: u8) -> Result<HostBuffer> {
    let mut b = HostBuffer::new(n)?;
    b.write_at(0, &pattern(n, seed));
    Ok(b)
}

fn mib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / f64::from(1 << 20)
}

#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_engine_reports_device_port_and_gid() -> Result<()> {
    let dev = device("verbs_engine_reports_device_port_and_gid");
    let e = engine(&dev, |b| b)?;
    let info = e.backend_info();
    eprintln!("{info:?}");
    ensure!(info.device == *dev);
    ensure!(info.port == 1 && [256, 512, 1024, 2048, 4096].contains(&info.mtu));
    ensure!(info.gid.is_some() && info.gid_index.is_some());
    ensure!(info.max_mr_bytes > 0 && info.qps_or_streams == 2);
    let devs = pagewire_transport::verbs::list_devices()?;
    let d = devs
        .iter()
        .find(|d| d.name == *dev)
        .context("device listed")?;
    ensure!(d.ports.iter().any(|p| p.state == "ACTIVE"), "{d:?}");
    ensure!(
        !d.gids.is_empty() && d.chosen_gid == info.gid_index,
        "{d:?}"
    );
    // Auto picks verbs when a device is usable, and says why.
    let auto = Engine::new(
        EngineConfig::builder()
            .listen("127.0.0.1:0".parse()?)
            .rdma_device(&*dev)
            .build()?,
    )?;
    ensure!(auto.backend_kind() == BackendKind::Verbs);
    eprintln!("auto selection: {}", auto.backend_info().selection);
    Ok(())
}

/// GID choice on the real table (an IPv4-mapped RoCE v2 entry wins when present, e.g. with
/// the harness's `--append sr.ip=10.9.9.1/24`), the `gid_index` override (explicit GID 0
/// connects and moves data), and an override that names no entry (typed config error).
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_gid_choice_and_override() -> Result<()> {
    let dev = device("verbs_gid_choice_and_override");
    let devs = pagewire_transport::verbs::list_devices()?;
    let d = devs
        .iter()
        .find(|d| d.name == *dev)
        .context("device listed")?;
    let chosen = d.chosen_gid.context("a GID was chosen")?;
    let g = d
        .gids
        .iter()
        .find(|g| g.port == 1 && g.index == chosen)
        .context("chosen GID in table")?;
    eprintln!(
        "{dev}: {} GIDs, chosen {chosen} = {} ({})",
        d.gids.len(),
        g.addr,
        g.kind
    );
    if d.gids
        .iter()
        .any(|g| g.port == 1 && g.addr.to_ipv4_mapped().is_some())
    {
        ensure!(
            g.addr.to_ipv4_mapped().is_some(),
            "IPv4-mapped GID not preferred: {d:?}"
        );
    }
    let n = 64 << 10;
    let a = engine(&dev, |b| b.gid_index(0))?;
    let b = engine(&dev, |b| b.gid_index(0))?;
    ensure!(a.backend_info().gid_index == Some(0));
    let src = filled(n, 5)?;
    let dst = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    a.submit(peer, Batch::new().write(src.addr(), dst.addr(), n as u64))?
        .wait(secs(30))?;
    ensure!(dst.to_vec() == src.to_vec());
    match engine(&dev, |b| b.gid_index(4000)) {
        Err(e) => match e.downcast_ref::<Error>() {
            Some(Error::Config { key, .. }) if key == "gid_index" => Ok(()),
            _ => bail!("unexpected error {e}"),
        },
        Ok(_) => bail!("GID index 4000 accepted"),
    }
}

/// Scattered local pages, contiguous remote range: WRs with equal-length SGE lists. Then
/// READ back into a differently scattered set. Bytes verified on both sides.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_sge_lists_scattered_local_contiguous_remote() -> Result<()> {
    let dev = device("verbs_sge_lists_scattered_local_contiguous_remote");
    const PAGE: usize = 4096;
    const PAGES: usize = 96;
    let a = engine(&dev, |b| b.qps_per_peer(2))?;
    let b = engine(&dev, |b| b)?;
    let src = filled(PAGE * PAGES * 3, 9)?;
    let back = HostBuffer::new(PAGE * PAGES * 2)?;
    let dst = HostBuffer::new(PAGE * PAGES)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    a.register(&back, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    // Local page i is page (3i+1) of `src`; remote pages are consecutive.
    let mut batch = Batch::new();
    for i in 0..PAGES {
        batch = batch.write(
            src.addr() + ((3 * i + 1) * PAGE) as u64,
            dst.addr() + (i * PAGE) as u64,
            PAGE as u64,
        );
    }
    a.submit(peer, batch.notify(5))?.wait(secs(30))?;
    let n = b.poll_notification(secs(10)).context("notification")?;
    ensure!(n.tag == 5);
    for i in 0..PAGES {
        let want = src.read_vec((3 * i + 1) * PAGE..(3 * i + 2) * PAGE);
        ensure!(
            dst.read_vec(i * PAGE..(i + 1) * PAGE) == want,
            "write page {i} differs"
        );
    }
    // READ back: remote contiguous, local every other page.
    let mut rb = Batch::new();
    for i in 0..PAGES {
        rb = rb.read(
            back.addr() + (2 * i * PAGE) as u64,
            dst.addr() + (i * PAGE) as u64,
            PAGE as u64,
        );
    }
    a.submit(peer, rb)?.wait(secs(30))?;
    for i in 0..PAGES {
        ensure!(
            back.read_vec(2 * i * PAGE..(2 * i + 1) * PAGE)
                == dst.read_vec(i * PAGE..(i + 1) * PAGE),
            "read page {i} differs"
        );
    }
    Ok(())
}

/// Eight QPs, 4 MiB sliced at 64 KiB and striped; the receiver checks the bytes right
/// after the notification (not after the sender's completion).
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_many_qps_notification_after_striped_writes() -> Result<()> {
    let dev = device("verbs_many_qps_notification_after_striped_writes");
    let n = 4 << 20;
    let a = engine(&dev, |b| {
        b.qps_per_peer(8).max_wr_bytes(64 << 10).signal_every(4)
    })?;
    let b = engine(&dev, |b| b.qps_per_peer(8))?;
    let src = filled(n, 3)?;
    let dst = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    ensure!(a.peer_info(peer)?.local_endpoint != a.peer_info(peer)?.remote_endpoint);
    for round in 0..3u32 {
        let t0 = Instant::now();
        let h = a.submit(
            peer,
            Batch::new()
                .write(src.addr(), dst.addr(), n as u64)
                .notify(100 + round),
        )?;
        let note = b.poll_notification(secs(60)).context("notification")?;
        let dt = t0.elapsed();
        ensure!(note.tag == 100 + round, "tag {}", note.tag);
        ensure!(
            dst.to_vec() == src.to_vec(),
            "round {round}: bytes differ at notification time"
        );
        h.wait(secs(30))?;
        eprintln!(
            "8 QPs: 4 MiB WRITE + notify in {dt:?} ({:.1} MiB/s)",
            mib_s(n, dt)
        );
    }
    // READ bandwidth on the same connection.
    let back = HostBuffer::new(n)?;
    a.register(&back, Access::LOCAL_WRITE)?;
    let t0 = Instant::now();
    a.submit(peer, Batch::new().read(back.addr(), dst.addr(), n as u64))?
        .wait(secs(60))?;
    let dt = t0.elapsed();
    ensure!(back.to_vec() == src.to_vec());
    eprintln!("8 QPs: 4 MiB READ in {dt:?} ({:.1} MiB/s)", mib_s(n, dt));
    Ok(())
}

/// A send queue window of 4 WRs, signalling every 3rd, and 512 single-page WRs (neither
/// side contiguous, so nothing merges): the poster must repeatedly wait for the completion
/// thread to retire groups, on both QPs, with every byte landing.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_small_window_many_wrs() -> Result<()> {
    let dev = device("verbs_small_window_many_wrs");
    const PAGE: usize = 4096;
    const PAGES: usize = 512;
    let a = engine(&dev, |b| b.qps_per_peer(2).tx_depth(4).signal_every(3))?;
    let b = engine(&dev, |b| b)?;
    ensure!(a.backend_info().tx_depth == 4);
    let src = filled(PAGE * PAGES * 2, 8)?;
    let dst = HostBuffer::new(PAGE * PAGES * 2)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    // Page i goes from src page 2i to dst page (2 * (PAGES - 1 - i) + 1): reversed, gapped.
    let mut batch = Batch::with_capacity(PAGES);
    for i in 0..PAGES {
        batch = batch.write(
            src.addr() + (2 * i * PAGE) as u64,
            dst.addr() + ((2 * (PAGES - 1 - i) + 1) * PAGE) as u64,
            PAGE as u64,
        );
    }
    let st = a.submit(peer, batch.notify(77))?.wait(secs(60))?;
    ensure!(st.bytes == (PAGE * PAGES) as u64, "{st:?}");
    ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 77);
    for i in 0..PAGES {
        let d = (2 * (PAGES - 1 - i) + 1) * PAGE;
        ensure!(
            dst.read_vec(d..d + PAGE) == src.read_vec(2 * i * PAGE..(2 * i + 1) * PAGE),
            "page {i}"
        );
        ensure!(
            dst.read_vec(d - PAGE..d).iter().all(|&x| x == 0),
            "gap before page {i} written"
        );
    }
    Ok(())
}

/// Manual progress: no completion thread, so a batch nobody reaps stays pending however
/// long it has been complete in the CQ; `Engine::reap` finishes it. With a zero spin
/// budget every wait goes straight to its slow phase, which must keep reaping (there is
/// no thread to wake it): a write's wait and a notification that arrives 200 ms into
/// `poll_notification`. Bytes checked on the receiving side.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_manual_progress_reaps_only_in_calls() -> Result<()> {
    let dev = device("verbs_manual_progress_reaps_only_in_calls");
    let manual =
        |b: EngineConfigBuilder| b.progress(ProgressMode::Manual).poll_spin(Duration::ZERO);
    let a = engine(&dev, manual)?;
    let b = engine(&dev, manual)?;
    ensure!(a.config().progress == ProgressMode::Manual);
    const N: usize = 64 << 10;
    let src = filled(N, 3)?;
    let dst = HostBuffer::new(N)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let (peer, _) = (
        a.connect(b.local_addr())?,
        b.accept(secs(10)).context("accept")?,
    );

    // Nobody reaps: still pending after rxe has long finished the 4 KiB write.
    let h = a.submit(peer, Batch::new().write(src.addr(), dst.addr(), 4096))?;
    std::thread::sleep(Duration::from_millis(200));
    ensure!(
        dst.read_vec(..4096) == src.read_vec(..4096),
        "the write itself did not land"
    );
    ensure!(
        matches!(h.status(), BatchStatus::Pending),
        "something reaped without a call: {:?}",
        h.status()
    );
    let until = secs(10);
    while !h.status().is_finished() {
        ensure!(
            Instant::now() < until,
            "Engine::reap never finished the batch"
        );
        a.reap();
    }
    ensure!(matches!(h.status(), BatchStatus::Done), "{:?}", h.status());

    // The waits' slow phase reaps by itself.
    a.submit(peer, Batch::new().write(src.addr(), dst.addr(), N as u64))?
        .wait(secs(30))?;
    ensure!(dst.to_vec() == src.to_vec(), "64 KiB write");
    std::thread::scope(|s| -> Result<()> {
        let sender = s.spawn(|| -> Result<()> {
            std::thread::sleep(Duration::from_millis(200));
            a.submit(
                peer,
                Batch::new().write(src.addr(), dst.addr(), 512).notify(91),
            )?
            .wait(secs(30))?;
            Ok(())
        });
        let n = b
            .poll_notification(secs(30))
            .context("notification never reaped")?;
        ensure!(n.tag == 91, "{n:?}");
        sender.join().expect("sender panicked")
    })?;
    ensure!(dst.read_vec(..512) == src.read_vec(..512));
    Ok(())
}

/// The peer deregisters its region, so our cached rkey is stale: the WRITE completes with
/// REM_ACCESS_ERR promptly, the connection is broken (both sides), later submits fail
/// fast, and after disconnect + connect transfers work again.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_qp_error_fails_promptly_then_reconnects() -> Result<()> {
    let dev = device("verbs_qp_error_fails_promptly_then_reconnects");
    let n = 1 << 20;
    let a = engine(&dev, |b| b)?;
    let b = engine(&dev, |b| b)?;
    let src = filled(n, 1)?;
    let dst = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    let rid = b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    b.deregister(rid)?;
    let t0 = Instant::now();
    let h = a.submit(peer, Batch::new().write(src.addr(), dst.addr(), n as u64))?;
    let err = h.wait(secs(10)).expect_err("stale rkey must fail");
    eprintln!("stale rkey -> {err} after {:?}", t0.elapsed());
    ensure!(
        t0.elapsed() < Duration::from_secs(5),
        "failure was not prompt"
    );
    match &err {
        Error::Completion { status_str, .. } if status_str == "REM_ACCESS_ERR" => {}
        other => bail!("expected REM_ACCESS_ERR, got {other}"),
    }
    match a.submit(peer, Batch::new().write(src.addr(), dst.addr(), 4096)) {
        Err(Error::PeerGone { .. }) => {}
        other => bail!("submit on a broken connection: {other:?}"),
    }
    // Reconnect (the peer registers its memory again) and move the data.
    a.disconnect(peer)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    a.submit(
        peer,
        Batch::new()
            .write(src.addr(), dst.addr(), n as u64)
            .notify(9),
    )?
    .wait(secs(30))?;
    ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 9);
    ensure!(dst.to_vec() == src.to_vec());
    Ok(())
}

/// Regions above `max_mr_bytes` are split into several MRs; a transfer that crosses MR
/// boundaries on both sides is resolved into per-MR pieces and lands intact. Registering
/// the same range again is free.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_registration_split_at_max_mr() -> Result<()> {
    let dev = device("verbs_registration_split_at_max_mr");
    let n = 1 << 20;
    let a = engine(&dev, |b| b.max_mr_bytes(64 << 10))?;
    let b = engine(&dev, |b| b.max_mr_bytes(96 << 10))?;
    let src = filled(n, 4)?;
    let dst = HostBuffer::new(n)?;
    let ra = a.register(&src, Access::LOCAL_WRITE)?;
    ensure!(
        a.register(&src, Access::LOCAL_WRITE)? == ra,
        "re-registration is not free"
    );
    let regions = a.regions();
    ensure!(regions.len() == 1 && regions[0].mrs == 16, "{regions:?}");
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    let off = 1000u64;
    let len = n as u64 - 2 * off;
    a.submit(
        peer,
        Batch::new().write(src.addr() + off, dst.addr() + off / 2, len),
    )?
    .wait(secs(30))?;
    ensure!(
        dst.read_vec(off as usize / 2..(off / 2 + len) as usize)
            == src.read_vec(off as usize..(off + len) as usize)
    );
    Ok(())
}

/// Two rxe devices on a veth pair: the bytes really cross a (virtual) wire.
#[test]
#[ignore = "needs two RDMA devices: runs in scripts/rdma-vm.sh --two-devices"]
fn verbs_two_devices_over_veth() -> Result<()> {
    let dev = device("verbs_two_devices_over_veth");
    let dev2 = std::env::var("RDMA_DEVICE2")
        .ok()
        .filter(|d| !d.is_empty())
        .context("RDMA_DEVICE2 is not set: run with scripts/rdma-vm.sh --two-devices")?;
    let n = 2 << 20;
    let a = engine(&dev, |b| b.qps_per_peer(4))?;
    let b = engine(&dev2, |b| b.qps_per_peer(4))?;
    let src = filled(n, 7)?;
    let dst = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    let t0 = Instant::now();
    a.submit(
        peer,
        Batch::new()
            .write(src.addr(), dst.addr(), n as u64)
            .notify(2),
    )?
    .wait(secs(60))?;
    let dt = t0.elapsed();
    ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 2);
    ensure!(dst.to_vec() == src.to_vec());
    eprintln!(
        "{dev} -> {dev2} over veth: 2 MiB in {dt:?} ({:.1} MiB/s)",
        mib_s(n, dt)
    );
    Ok(())
}

/// `RDMA_RAILS` (`--two-rails`), else `RDMA_DEVICE` and `RDMA_DEVICE2` as one rail list
/// (`rxe0,rxe1`), for the multi-rail tests; `RDMA_DEVICE` may already be a list.
fn two_rails(test: &str) -> Result<String> {
    let dev = device(test);
    if let Ok(rails) = std::env::var("RDMA_RAILS")
        && rails.contains(',')
    {
        return Ok(rails);
    }
    if dev.contains(',') {
        return Ok(dev.to_string());
    }
    let dev2 = std::env::var("RDMA_DEVICE2")
        .ok()
        .filter(|d| !d.is_empty())
        .context("RDMA_DEVICE2 is not set: run with scripts/rdma-vm.sh --two-devices")?;
    Ok(format!("{dev},{dev2}"))
}

/// A batch between two engines on two rails each is striped over both: every byte
/// arrives (checked on the receiving side), the notification comes after all of it, a
/// READ back over both rails returns the same bytes, and both rails' counters show bytes.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_two_rails_stripe_a_batch() -> Result<()> {
    let rails = two_rails("verbs_two_rails_stripe_a_batch")?;
    let _links = rail_links();
    let n = 8 << 20;
    let a = engine(&rails, |b| b.max_wr_bytes(1 << 20))?;
    let b = engine(&rails, |b| b.max_wr_bytes(1 << 20))?;
    ensure!(
        a.backend_info().rails.len() == 2,
        "rails: {:?}",
        a.backend_info().rails
    );
    let src = filled(n, 3)?;
    let dst = HostBuffer::new(n)?;
    let back = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    a.register(&back, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    // One op and a scattered batch (4 KiB pieces in reverse order), both notified.
    a.submit(
        peer,
        Batch::new()
            .write(src.addr(), dst.addr(), n as u64)
            .notify(11),
    )?
    .wait(secs(60))?;
    ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 11);
    ensure!(
        dst.to_vec() == src.to_vec(),
        "bytes differ after the striped WRITE"
    );
    let mut scattered = Batch::new();
    for k in (0..64u64).rev() {
        scattered = scattered.read(back.addr() + k * 4096, dst.addr() + k * 4096, 4096);
    }
    a.submit(
        peer,
        scattered.read(
            back.addr() + (256 << 10),
            dst.addr() + (256 << 10),
            (n - (256 << 10)) as u64,
        ),
    )?
    .wait(secs(60))?;
    ensure!(
        back.to_vec() == src.to_vec(),
        "bytes differ after the striped READ"
    );
    let stats = a.rail_stats();
    eprintln!("rails {rails}: {stats:?}");
    ensure!(stats.len() == 2, "{stats:?}");
    ensure!(
        stats.iter().all(|r| r.bytes > 0),
        "a rail carried nothing: {stats:?}"
    );
    ensure!(stats.iter().map(|r| r.bytes).sum::<u64>() >= 2 * n as u64);
    ensure!(
        stats.iter().all(|r| r.errors == 0 && r.retries == 0),
        "{stats:?}"
    );
    Ok(())
}

/// A registration's batches keep to the rails its memory prefers: with the priority
/// list naming only the second rail for node 0, a batch from a buffer placed on node 0
/// puts every byte on that rail; placed nowhere (`Any`), it is striped over both again.
/// Bytes are checked on the receiving side each time.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_two_rails_follow_the_memory_s_preference() -> Result<()> {
    use pagewire_transport::topology::MemoryLocation;
    let rails = two_rails("verbs_two_rails_follow_the_memory_s_preference")?;
    let _links = rail_links();
    let second = rails
        .split(',')
        .nth(1)
        .and_then(|r| r.split(':').next())
        .context("two rails")?
        .to_string();
    let n = 8 << 20;
    let prio = format!("cpu:0={second}").parse()?;
    let a = engine(&rails, |b| b.max_wr_bytes(1 << 20).rail_priority(prio))?;
    let b = engine(&rails, |b| b.max_wr_bytes(1 << 20))?;
    let src = filled(n, 5)?;
    let mut dst = HostBuffer::new(n)?;
    let id = a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    let before = |a: &Engine| a.rail_stats().iter().map(|r| r.bytes).collect::<Vec<_>>();
    for (loc, both) in [
        (MemoryLocation::HostNode(0), false),
        (MemoryLocation::Any, true),
    ] {
        a.set_memory_location(id, &loc)?;
        let b0 = before(&a);
        dst.fill(0);
        a.submit(
            peer,
            Batch::new()
                .write(src.addr(), dst.addr(), n as u64)
                .notify(12),
        )?
        .wait(secs(60))?;
        ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 12);
        ensure!(dst.to_vec() == src.to_vec(), "{loc}: bytes differ");
        let moved: Vec<u64> = before(&a).iter().zip(&b0).map(|(x, y)| x - y).collect();
        eprintln!("{loc}: bytes per rail {moved:?}");
        if both {
            ensure!(moved.iter().all(|&m| m > 0), "{loc}: {moved:?}");
        } else {
            ensure!(moved[0] == 0 && moved[1] >= n as u64, "{loc}: {moved:?}");
        }
    }
    Ok(())
}

/// Held by the tests that use rail 1, so no other device test runs while one of them takes
/// that rail's link down (or is striping over it).
fn rail_links() -> std::sync::RwLockWriteGuard<'static, ()> {
    LINKS.write().unwrap_or_else(|p| p.into_inner())
}

/// Two engines' rail lists whose rail i crosses veth pair i, and this side's netdev of
/// each rail (`RDMA_RAILS`, `RDMA_PEER_RAILS`, `SOFTROCE_RAIL_NDEVS` of `--two-rails`).
fn rail_pairs(test: &str) -> Result<(String, String, Vec<String>)> {
    device(test);
    let var = |k: &str| {
        std::env::var(k)
            .ok()
            .filter(|v| v.contains(','))
            .with_context(|| format!("{k} is not set: run with scripts/rdma-vm.sh --two-rails"))
    };
    let ndevs = var("SOFTROCE_RAIL_NDEVS")?;
    Ok((
        var("RDMA_RAILS")?,
        var("RDMA_PEER_RAILS")?,
        ndevs.split(',').map(str::to_string).collect(),
    ))
}

/// A netdev taken down for a test; up again when dropped, whatever the test did.
struct LinkDown(String);

fn ip_link(dev: &str, state: &str) -> Result<()> {
    // The guest's PATH is the host's, which may lack the sbin directories.
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("ip");
    let st = std::process::Command::new(ip)
        .args(["link", "set", dev, state])
        .status()
        .with_context(|| format!("running {ip} link set {dev} {state}"))?;
    ensure!(st.success(), "ip link set {dev} {state}: {st}");
    Ok(())
}

impl LinkDown {
    fn new(dev: &str) -> Result<Self> {
        ip_link(dev, "down")?;
        Ok(LinkDown(dev.to_string()))
    }

    fn up(self) -> Result<()> {
        let dev = self.0.clone();
        std::mem::forget(self);
        ip_link(&dev, "up")
    }
}

impl Drop for LinkDown {
    fn drop(&mut self) {
        let _ = ip_link(&self.0, "up");
    }
}

/// `n` bytes of the test pattern, written a MiB at a time (no second copy of a large
/// buffer in the guest's memory).
fn filled_large(n: usize, seed: u8) -> Result<HostBuffer> {
    let mut b = HostBuffer::new(n)?;
    for off in (0..n).step_by(1 << 20) {
        let len = (1 << 20).min(n - off);
        b.write_at(off, &pattern_at(off, len, seed));
    }
    Ok(b)
}

/// Whether `a` and `b` hold the same bytes, compared a MiB at a time.
fn same_bytes(a: &HostBuffer, b: &HostBuffer, n: usize) -> bool {
    (0..n).step_by(1 << 20).all(|off| {
        a.read_vec(off..(off + (1 << 20)).min(n)) == b.read_vec(off..(off + (1 << 20)).min(n))
    })
}

/// Submits `batch`, takes `ndev` down `after` that (from another thread: on rxe the
/// submitting thread itself does much of the sending), and waits for the batch; returns
/// the time from submit and from the link-down command, and the link (down until dropped
/// or brought up). Fails if rail `rail` had carried its whole part (`part` bytes) by the
/// time the link was down.
fn fail_rail_mid_batch(
    a: &Engine,
    peer: pagewire_transport::PeerId,
    batch: Batch,
    (rail, part): (usize, u64),
    ndev: &str,
    after: Duration,
) -> Result<(Duration, Duration, LinkDown)> {
    let before = a.rail_stats()[rail].bytes;
    let t0 = Instant::now();
    let (submitted, downed) = std::thread::scope(|s| {
        let downer = s.spawn(|| -> Result<_> {
            std::thread::sleep(after);
            let t = Instant::now();
            let d = LinkDown::new(ndev)?;
            Ok((t, Instant::now(), d, a.rail_stats()))
        });
        let h = a.submit(peer, batch);
        (h, downer.join().expect("the link-down thread panicked"))
    });
    let (t_down, t_done, down, at_down) = downed?;
    let h = submitted?;
    eprintln!(
        "{ndev} down between {:?} and {:?} after submit, rails {at_down:?}",
        t_down - t0,
        t_done - t0
    );
    ensure!(
        at_down[rail].bytes < before + part,
        "rail {rail} had finished its part before its link went down: {at_down:?}"
    );
    h.wait(secs(60))
        .with_context(|| format!("batch with {ndev} down, rails {:?}", a.rail_stats()))?;
    Ok((t0.elapsed(), t_down.elapsed(), down))
}

/// Rail 1's link goes down in the middle of a 128 MiB striped WRITE: the batch completes on
/// rail 0 within its deadline, every byte lands, the notification arrives once, rail 1's
/// failure and rail 0's re-posted parts are counted. Then the same for a READ. With the
/// link up again, rail 1 carries bytes again.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_rail_fails_mid_batch() -> Result<()> {
    let (mine, theirs, ndevs) = rail_pairs("verbs_rail_fails_mid_batch")?;
    let _links = rail_links();
    // Large enough that rail 1's half is still moving when `ip link` returns (up to 0.55 s
    // after it starts), with the guest's CPU to this test alone.
    let n = 128 << 20;
    // Every 1 MiB WR signalled: a rail's byte counter moves per MiB, and a rail that the
    // guest's CPU serves slowly still completes a WR well inside the stall watchdog's 5 s.
    let cfg = |b: EngineConfigBuilder| b.max_wr_bytes(1 << 20).signal_every(1);
    let a = engine(&mine, cfg)?;
    let b = engine(&theirs, cfg)?;
    let src = filled_large(n, 5)?;
    let dst = HostBuffer::new(n)?;
    let back = HostBuffer::new(n)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    a.register(&back, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    let peer = a.connect(b.local_addr())?;
    eprintln!("connected over {mine} / {theirs}: {:?}", a.rail_stats());

    // WRITE, rail 1 down 50 ms into it (rxe moves 20-60 MiB/s a rail here).
    let write = Batch::new()
        .write(src.addr(), dst.addr(), n as u64)
        .notify(31);
    let half = (1, n as u64 / 2);
    let early = Duration::from_millis(50);
    let (took, since_down, down) = fail_rail_mid_batch(&a, peer, write, half, &ndevs[1], early)?;
    let stats = a.rail_stats();
    eprintln!(
        "WRITE with {} down: {took:?} in all, {since_down:?} after the link-down command; rails {stats:?}",
        ndevs[1]
    );
    ensure!(b.poll_notification(secs(10)).context("notification")?.tag == 31);
    ensure!(
        b.poll_notification(Instant::now() + Duration::from_millis(500))
            .is_none(),
        "a second notification"
    );
    ensure!(same_bytes(&src, &dst, n), "bytes differ after the WRITE");
    ensure!(
        stats[1].errors >= 1,
        "rail 1's failure not counted: {stats:?}"
    );
    ensure!(
        stats[0].retries >= 1,
        "no part re-posted on rail 0: {stats:?}"
    );
    // Rail 1 stays out while its link is down: a batch goes over rail 0 alone.
    let r1 = a.rail_stats()[1].bytes;
    a.submit(peer, Batch::new().write(src.addr(), dst.addr(), 8 << 20))?
        .wait(secs(60))?;
    ensure!(
        a.rail_stats()[1].bytes == r1,
        "rail 1 carried bytes while down"
    );

    // Link up: the rail comes back (probed), and then carries bytes again.
    down.up()?;
    let peer = rail_back(&a, &b, peer, 1)?;

    // READ, rail 1 down 100 ms into it.
    let read = Batch::new().read(back.addr(), dst.addr(), n as u64);
    let (took, since_down, down) = fail_rail_mid_batch(&a, peer, read, half, &ndevs[1], early)?;
    let stats2 = a.rail_stats();
    eprintln!(
        "READ with {} down: {took:?} in all, {since_down:?} after the link-down command; rails {stats2:?}",
        ndevs[1]
    );
    ensure!(same_bytes(&src, &back, n), "bytes differ after the READ");
    ensure!(stats2[1].errors > stats[1].errors, "{stats2:?}");
    ensure!(stats2[0].retries > stats[0].retries, "{stats2:?}");
    down.up()?;
    rail_back(&a, &b, peer, 1)?;
    Ok(())
}

/// A notification whose rail fails under it goes again on the other rail and arrives
/// once. The engines list their rails the other way round here, so rail 0, where a
/// tag-only batch's notification goes, is rxe1 on veth1; its link goes down before the
/// engine has noticed anything, so the notification is posted there and fails.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_notification_fails_over_to_another_rail() -> Result<()> {
    let (mine, theirs, ndevs) = rail_pairs("verbs_notification_fails_over_to_another_rail")?;
    let _links = rail_links();
    let reversed = |l: &str| l.split(',').rev().collect::<Vec<_>>().join(",");
    let a = engine(&reversed(&mine), |b| b)?;
    let b = engine(&reversed(&theirs), |b| b)?;
    let peer = a.connect(b.local_addr())?;
    a.submit(peer, Batch::new().notify(1))?.wait(secs(30))?;
    ensure!(
        b.poll_notification(secs(10))
            .context("first notification")?
            .tag
            == 1
    );
    let down = LinkDown::new(&ndevs[1])?;
    let t0 = Instant::now();
    a.submit(peer, Batch::new().notify(2))?
        .wait(secs(30))
        .with_context(|| format!("notification with {} down: {:?}", ndevs[1], a.rail_stats()))?;
    let took = t0.elapsed();
    ensure!(
        b.poll_notification(secs(10))
            .context("second notification")?
            .tag
            == 2
    );
    ensure!(
        b.poll_notification(Instant::now() + Duration::from_millis(500))
            .is_none(),
        "the notification arrived twice"
    );
    let stats = a.rail_stats();
    eprintln!(
        "notification with {} down: {took:?}; rails {stats:?}",
        ndevs[1]
    );
    ensure!(
        stats[0].errors == 1 && stats[1].retries == 1,
        "the notification did not fail over: {stats:?}"
    );
    down.up()
}

/// Waits (up to 30 s) until rail `rail` carries bytes again after its link came back:
/// 4 MiB WRITEs until its byte counter moves. Returns the peer to use from then on.
fn rail_back(
    a: &Engine,
    b: &Engine,
    peer: pagewire_transport::PeerId,
    rail: usize,
) -> Result<pagewire_transport::PeerId> {
    let t0 = Instant::now();
    let src = filled(4 << 20, 9)?;
    let dst = HostBuffer::new(4 << 20)?;
    a.register(&src, Access::LOCAL_WRITE)?;
    b.register(&dst, Access::ALL)?;
    a.redescribe(peer)?;
    loop {
        let before = a.rail_stats()[rail].bytes;
        a.submit(peer, Batch::new().write(src.addr(), dst.addr(), 4 << 20))?
            .wait(secs(60))?;
        if a.rail_stats()[rail].bytes > before {
            ensure!(dst.to_vec() == src.to_vec());
            eprintln!(
                "rail {rail} back after {:?}: {:?}",
                t0.elapsed(),
                a.rail_stats()
            );
            return Ok(peer);
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(30),
            "rail {rail} did not come back: {:?}",
            a.rail_stats()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The READ of issue 31's checks: 16 MiB, so that it is still moving when the peer's links
/// go down 50 ms into it.
const STALLED: usize = 16 << 20;
/// What the READ's target holds before it.
const GUARD: u8 = 0xa5;

/// One round of issue 31's check: `run` starts a [`STALLED`]-byte READ of `src` (on `b`)
/// into `dst` (registered on `a` as `region` here) over a fresh connection, waits for it to
/// end and returns the error it ended with; 50 ms after `run` starts, the peer's netdevs
/// `ndevs` go down (from another thread: on rxe the submitting thread itself moves much of
/// the data, inside the post), so the READ stalls. Its target must be the caller's again
/// at once: deregistering it right after the READ ended must not wait (the failure, or
/// the cancellation, is reported only once nothing of the READ can land any more). With
/// the links back up, not one more byte of it may land. Returns how long the
/// deregistration waited, or `None` when the READ finished before the links went down
/// (the guest's speed varies a few times over; `ip link` may take longer than the READ):
/// nothing was checked, and the caller tries again.
fn stalled_read_lets_go(
    (a, b): (&Engine, &Engine),
    (src, dst): (&HostBuffer, &mut HostBuffer),
    ndevs: &[String],
    what: &str,
    run: impl FnOnce(pagewire_transport::PeerId, Batch) -> Result<Option<Error>>,
) -> Result<Option<Duration>> {
    // Reads again first: a connection made right after links came back may not reach
    // the peer yet (its GIDs return a moment later).
    dst.fill(0);
    let region = a.register(dst, Access::LOCAL_WRITE)?;
    let peer = reads_again(a, b, src, dst)?;
    dst.fill(GUARD);
    let read = Batch::new()
        .read(dst.addr(), src.addr(), STALLED as u64)
        .timeout(Duration::from_millis(500));
    let t0 = Instant::now();
    let (got, down) = std::thread::scope(|s| {
        let downer = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            ndevs
                .iter()
                .map(|d| LinkDown::new(d))
                .collect::<Result<Vec<_>>>()
        });
        let got = run(peer, read);
        (got, downer.join().expect("the link-down thread panicked"))
    });
    let ended = Instant::now();
    let down = down?;
    let Some(err) = got? else {
        for d in down {
            d.up()?;
        }
        a.deregister_wait(region, Instant::now() + Duration::from_secs(3))?;
        a.disconnect(peer)?;
        return Ok(None);
    };
    // Deregistered right away: the READ ended once nothing of it could land any more.
    a.deregister_wait(region, ended + Duration::from_secs(3))
        .with_context(|| format!("the {what} READ's target is still pinned 3 s after it ended"))?;
    let waited = ended.elapsed();
    eprintln!(
        "{what} READ ended {:?} after it started ({err}); its target deregistered {waited:?} after that",
        ended - t0
    );
    ensure!(
        matches!(
            err,
            Error::Timeout { .. }
                | Error::Completion { .. }
                | Error::PeerGone { .. }
                | Error::Cancelled
        ),
        "{what} READ: unexpected error {err:?}"
    );
    ensure!(
        waited < Duration::from_millis(100),
        "the {what} READ's target stayed pinned for {waited:?}"
    );
    let snap = dst.to_vec();
    let landed = snap.iter().filter(|&&x| x != GUARD).count();
    // The links back, and time for a retransmission: nothing of the READ may land now.
    for d in down {
        d.up()?;
    }
    std::thread::sleep(Duration::from_secs(1));
    let later = dst.to_vec();
    let late = if later == snap {
        0
    } else {
        snap.iter().zip(&later).filter(|(x, y)| x != y).count()
    };
    eprintln!("{what} READ: {landed} bytes had landed when it ended, {late} after");
    ensure!(late == 0, "{late} bytes landed after the {what} READ ended");
    // The connection broke (its QPs were moved to ERR to flush the READ).
    a.disconnect(peer)?;
    Ok(Some(waited))
}

/// Connects `a` to `b` until a 1 MiB READ of `src` into `dst` (registered) goes through,
/// for 30 s at most (after a link came back, its GID returns a moment later).
fn reads_again(
    a: &Engine,
    b: &Engine,
    src: &HostBuffer,
    dst: &HostBuffer,
) -> Result<pagewire_transport::PeerId> {
    let small = 1 << 20;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let again = a.connect(b.local_addr()).and_then(|p| {
            a.submit(p, Batch::new().read(dst.addr(), src.addr(), small as u64))?
                .wait(secs(30))?;
            Ok(p)
        });
        match again {
            Ok(p) => {
                ensure!(same_bytes(src, dst, small), "bytes differ after connecting");
                return Ok(p);
            }
            Err(e) if Instant::now() < until => {
                eprintln!("not back yet: {e}");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => return Err(e).context("no READ after the links came back"),
        }
    }
}

/// A READ of a submitted batch: its error (`None`: it finished before the links went
/// down).
fn submitted(a: &Engine, peer: pagewire_transport::PeerId, read: Batch) -> Result<Option<Error>> {
    Ok(a.submit(peer, read).and_then(|h| h.wait(secs(30))).err())
}

/// A READ of a prepared batch, one run: its error (`None`: it finished before the links
/// went down); the prepared batch is dropped before this returns (its regions stay
/// pinned while it lives). `fast`: whether it must take the verbs fast path.
fn prepared(
    a: &Engine,
    peer: pagewire_transport::PeerId,
    read: Batch,
    fast: bool,
) -> Result<Option<Error>> {
    let mut p = a.prepare(peer, read)?;
    ensure!(p.is_fast_path() == fast, "fast path: {}", p.is_fast_path());
    p.start()?;
    let got = p.wait(secs(30));
    ensure!(
        p.try_wait().is_some_and(|r| r.is_ok()),
        "the run that ended still counts as running"
    );
    Ok(got.err())
}

/// A READ cancelled 150 ms after it was submitted (its own deadline far off): `Cancelled`.
fn cancelled(a: &Engine, peer: pagewire_transport::PeerId, read: Batch) -> Result<Option<Error>> {
    let h = a.submit(peer, read.timeout(Duration::from_secs(30)))?;
    std::thread::sleep(Duration::from_millis(150));
    ensure!(h.cancel(), "the READ finished before it was cancelled");
    ensure!(
        matches!(h.status(), BatchStatus::Cancelled),
        "{:?}",
        h.status()
    );
    Ok(Some(Error::Cancelled))
}

/// [`stalled_read_lets_go`] for a submitted, a prepared (`fast`: on the verbs fast path)
/// and a cancelled READ in turn, between `a` and `b`, the peer's netdevs `ndevs` going
/// down in each. Returns the deregistration waits; a new connection carries a READ again
/// at the end.
fn stalled_reads_let_go(
    a: &Engine,
    b: &Engine,
    ndevs: &[String],
    fast: bool,
) -> Result<Vec<Duration>> {
    // Plain fills: a pattern costs seconds under the guest's emulated CPU.
    let mut src = HostBuffer::new(STALLED)?;
    src.fill(0x5a);
    let mut dst = HostBuffer::new(STALLED)?;
    b.register(&src, Access::ALL)?;
    let mut waits = Vec::new();
    for what in ["failed", "prepared", "cancelled"] {
        let mut tries = 0;
        let waited = loop {
            let run = |p, r| {
                let before = a.rail_stats();
                let got = match what {
                    "failed" => submitted(a, p, r),
                    "prepared" => prepared(a, p, r, fast),
                    _ => cancelled(a, p, r),
                };
                let moved: Vec<u64> = a
                    .rail_stats()
                    .iter()
                    .zip(&before)
                    .map(|(x, y)| x.bytes - y.bytes)
                    .collect();
                eprintln!("{what} READ: bytes per rail {moved:?}");
                got
            };
            tries += 1;
            match stalled_read_lets_go((a, b), (&src, &mut dst), ndevs, what, run)? {
                Some(w) => break w,
                None if tries < 3 => {
                    eprintln!("{what} READ: finished before the links went down; again");
                }
                None => bail!("the {what} READ finished before the links went down, {tries} times"),
            }
        };
        waits.push(waited);
    }
    a.register(&dst, Access::LOCAL_WRITE)?;
    reads_again(a, b, &src, &dst)?;
    Ok(waits)
}

/// Issue 31: a READ whose peer stops answering (the peer's link goes down 50 ms into a
/// 16 MiB READ) fails at its 500 ms deadline, and its target is the caller's again at
/// once: the failure is reported only after the READ's QPs were moved to ERR and its WRs
/// flushed, so deregistering right after it does not wait (it waited until the broken
/// connection was dropped). The same for a prepared READ on the fast path (at its run's
/// deadline), and for a READ cancelled while stalled (its WRs do not complete within the
/// bound, so they are flushed too). With the link back up, not one more byte of any of
/// them lands, and a new connection moves data again.
#[test]
#[ignore = "needs two RDMA devices: runs in scripts/rdma-vm.sh --two-devices"]
fn verbs_failed_read_lets_go_of_its_target() -> Result<()> {
    let dev = device("verbs_failed_read_lets_go_of_its_target").to_string();
    let var = |k: &str| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .with_context(|| format!("{k} is not set: run with scripts/rdma-vm.sh --two-devices"))
    };
    let (dev2, ndev2) = (var("RDMA_DEVICE2")?, var("SOFTROCE_NDEV2")?);
    // A link goes down: no other device test runs meanwhile.
    let _links = rail_links();
    // Every 1 MiB WR signalled, as in the failover tests.
    let cfg = |b: EngineConfigBuilder| b.max_wr_bytes(1 << 20).signal_every(1);
    let a = engine(&dev, cfg)?;
    let b = engine(&dev2, cfg)?;
    let waits = stalled_reads_let_go(&a, &b, &[ndev2], true)?;
    eprintln!("deregistration waits (failed, prepared, cancelled): {waits:?}");
    Ok(())
}

/// Issue 31 on two rails: a READ striped over both rails whose peer stops answering on
/// both (the peer's two links go down 50 ms into it) fails at its 500 ms deadline once
/// every rail's part was stopped (each rail's QPs moved to ERR and its WRs flushed), so
/// its target is the caller's again at once. The same for a prepared READ (on two rails
/// each run is an ordinary striped batch) and for a striped READ cancelled while stalled.
/// With the links back up, not one more byte lands.
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_failed_two_rail_read_lets_go_of_its_target() -> Result<()> {
    let (mine, theirs, ndevs) = rail_pairs("verbs_failed_two_rail_read_lets_go_of_its_target")?;
    let _links = rail_links();
    // The peer's end of each rail's veth pair: the harness names it after this side's,
    // with a `p` (docs/testing.md).
    let peer_ndevs: Vec<String> = ndevs.iter().map(|d| format!("{d}p")).collect();
    let cfg = |b: EngineConfigBuilder| b.max_wr_bytes(1 << 20).signal_every(1);
    let a = engine(&mine, cfg)?;
    let b = engine(&theirs, cfg)?;
    let waits = stalled_reads_let_go(&a, &b, &peer_ndevs, false)?;
    eprintln!("deregistration waits (failed, prepared, cancelled; two rails): {waits:?}");
    Ok(())
}

// ---------------------------------------------------------------- no device (runs everywhere)

/// Forcing verbs with a device that does not exist is a typed error, never a hang or a
/// silent fallback.
#[test]
fn forced_verbs_without_device_is_backend_unavailable() -> Result<()> {
    let r = Engine::new(
        EngineConfig::builder()
            .backend(BackendKind::Verbs)
            .listen("127.0.0.1:0".parse()?)
            .rdma_device("no_such_rdma_dev0")
            .build()?,
    );
    match r {
        Err(Error::BackendUnavailable { backend, reason }) => {
            ensure!(backend == BackendKind::Verbs);
            eprintln!("forced verbs: {reason}");
            Ok(())
        }
        Err(e) => bail!("unexpected error {e}"),
        Ok(e) => bail!("engine opened with backend {}", e.backend_kind()),
    }
}

/// `Auto` falls back to TCP when no usable device exists, and says why.
#[test]
fn auto_without_device_falls_back_to_tcp() -> Result<()> {
    let e = Engine::new(
        EngineConfig::builder()
            .backend(BackendKind::Auto)
            .listen("127.0.0.1:0".parse()?)
            .rdma_device("no_such_rdma_dev0")
            .build()?,
    )?;
    ensure!(e.backend_kind() == BackendKind::Tcp, "{}", e.backend_kind());
    let why = e.backend_info().selection;
    ensure!(
        why.contains("no_such_rdma_dev0") || why.contains("RDMA"),
        "{why}"
    );
    eprintln!("auto: {why}");
    Ok(())
}

/// dma-buf registration on TCP: `Unsupported`, never a crash.
#[test]
fn tcp_dmabuf_registration_is_unsupported() -> Result<()> {
    use std::os::fd::AsFd;
    let f = std::fs::File::open("/dev/null")?;
    let tcp = Engine::new(
        EngineConfig::builder()
            .backend(BackendKind::Tcp)
            .listen("127.0.0.1:0".parse()?)
            .build()?,
    )?;
    // SAFETY: the call fails before anything is registered (TCP has no dma-buf path).
    match unsafe { tcp.register_dmabuf(f.as_fd(), 0, 1 << 20, 0x7000_0000_0000, Access::ALL) } {
        Err(Error::Unsupported { .. }) => {}
        other => bail!("tcp register_dmabuf: {other:?}"),
    }
    Ok(())
}

/// The verbs half: `ibv_reg_dmabuf_mr` refuses an fd that is not a dma-buf with a typed
/// error (rxe has no dma-buf support at all).
#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn verbs_dmabuf_registration_error_is_typed() -> Result<()> {
    use std::os::fd::AsFd;
    let f = std::fs::File::open("/dev/null")?;
    let dev = device("verbs_dmabuf_registration_error_is_typed");
    let e = engine(&dev, |b| b)?;
    // SAFETY: /dev/null is not a dma-buf, so `ibv_reg_dmabuf_mr` must refuse it; nothing
    // is registered and no memory is ever touched.
    match unsafe { e.register_dmabuf(f.as_fd(), 0, 1 << 20, 0x7000_0000_0000, Access::ALL) } {
        Err(Error::Registration { reason, .. }) => eprintln!("dma-buf on {dev}: {reason}"),
        other => bail!("verbs register_dmabuf of /dev/null: {other:?}"),
    }
    ensure!(e.regions().is_empty());
    Ok(())
}
