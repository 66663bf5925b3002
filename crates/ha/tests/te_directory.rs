//! The Mooncake transfer engine with its metadata on a real etcd (`etcd://`): engines
//! publish their names, open each other by name and move bytes; a closed engine's name
//! disappears; unknown, stale and malformed names fail with their codes; an etcd that
//! is down or stopped fails the engine's start within its deadline. Needs the `etcd`
//! binary (scripts/setup.sh).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use pagewire_ha::mooncake::segment_key;
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{Etcd, new_engine};
use pagewire_mooncake::{
    Code, LOCAL_SEGMENT, Options, SegmentDescriptor, Transfer, TransferEngine,
};

fn opts() -> Options {
    Options {
        protocol: Some("tcp".into()),
        handshake_timeout: Some(Duration::from_secs(2)),
        transfer_timeout: Duration::from_secs(5),
        ..Options::default()
    }
}

fn engine(url: &str, name: &str) -> Result<TransferEngine> {
    new_engine(url, name, opts()).with_context(|| format!("engine {name}"))
}

fn code<T: std::fmt::Debug>(r: Result<T, pagewire_mooncake::Error>) -> Code {
    r.expect_err("should fail").code()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// A pattern that differs per byte and per seed.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

#[test]
fn engines_find_each_other_by_name_through_etcd() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let url = cluster.url();
    let etcd = Etcd::connect(&url, soon())?;

    let prefill = engine(&url, "127.0.0.1:prefill-0")?;
    let decode = engine(&url, "127.0.0.1:decode-0")?;
    assert_eq!(decode.name(), "127.0.0.1:decode-0");
    assert!(
        decode.rpc_name().starts_with("127.0.0.1:"),
        "{}",
        decode.rpc_name()
    );

    // The descriptor in etcd names decode's handshake address and engine.
    let entry = etcd
        .get(&segment_key("", "127.0.0.1:decode-0"), soon())?
        .context("decode-0 is published")?;
    let desc = SegmentDescriptor::decode(&entry.value).map_err(anyhow::Error::msg)?;
    assert_eq!(desc.name, "127.0.0.1:decode-0");
    assert_eq!(desc.rpc, decode.rpc_name());
    assert_eq!(desc.engine_id, decode.transport().id());

    let mut pool = vec![0u8; 1 << 20];
    let page = pattern(64 << 10, 7);
    let mut back = vec![0u8; 64 << 10];
    let (pool_a, page_a, back_a) = (
        pool.as_mut_ptr() as u64,
        page.as_ptr() as u64,
        back.as_mut_ptr() as u64,
    );
    // SAFETY: the buffers outlive the engines (both are closed below, before the end).
    unsafe {
        decode.register(pool_a, pool.len() as u64, true)?;
        prefill.register(page_a, page.len() as u64, false)?;
        prefill.register(back_a, back.len() as u64, false)?;
    }

    // By name, as Python's transfer_sync_write/read do.
    let (len, at, src, dst) = ([page.len() as u64], [pool_a + 4096], [page_a], [back_a]);
    prefill.transfer_sync(
        &Transfer::write("127.0.0.1:decode-0", &src, &at, &len),
        None,
    )?;
    prefill.transfer_sync(&Transfer::read("127.0.0.1:decode-0", &dst, &at, &len), None)?;
    assert_eq!(back, page, "read back what was written");

    // The C API's way: a segment id by name; the own name is LOCAL_SEGMENT.
    let seg = prefill.open_segment("127.0.0.1:decode-0", false)?;
    assert!(seg > LOCAL_SEGMENT);
    assert_eq!(prefill.open_segment("127.0.0.1:decode-0", true)?, seg);
    assert_eq!(
        prefill.open_segment("127.0.0.1:prefill-0", false)?,
        LOCAL_SEGMENT
    );

    // Unknown names: Mooncake's -1, and send_probe's kMetadata.
    assert_eq!(
        code(prefill.open_segment("nobody", false)),
        Code::InvalidArgument
    );
    assert_eq!(code(prefill.open_segment("", false)), Code::InvalidArgument);
    let to_nobody = Transfer::write("nobody", &src, &at, &len);
    assert_eq!(
        code(prefill.transfer_sync(&to_nobody, None)),
        Code::InvalidArgument
    );
    assert_eq!(code(prefill.send_probe("nobody")), Code::Metadata);
    prefill.send_probe("127.0.0.1:decode-0")?;

    // A live name cannot be taken by another engine.
    let dup = new_engine(&url, "127.0.0.1:decode-0", opts());
    let e = dup.expect_err("a second decode-0");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.to_string().contains("held by another live engine"), "{e}");

    // The bytes landed on the receiving side.
    decode.close();
    assert_eq!(&pool[4096..4096 + page.len()], &page[..]);

    // Closing withdrew the name: gone from etcd, and a fresh open fails.
    ensure!(
        etcd.get(&segment_key("", "127.0.0.1:decode-0"), soon())?
            .is_none(),
        "decode-0 still in etcd"
    );
    prefill.close_segment(seg)?;
    assert_eq!(
        code(prefill.open_segment("127.0.0.1:decode-0", false)),
        Code::InvalidArgument
    );

    // The name is free again.
    let again = engine(&url, "127.0.0.1:decode-0")?;
    assert!(prefill.open_segment("127.0.0.1:decode-0", false)? > 0);
    again.close();
    prefill.close();
    ensure!(
        etcd.get(&segment_key("", "127.0.0.1:prefill-0"), soon())?
            .is_none(),
        "prefill-0 still in etcd"
    );
    Ok(())
}

#[test]
fn stale_and_malformed_entries_are_refused() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let url = cluster.url();
    let etcd = Etcd::connect(&url, soon())?;
    let a = engine(&url, "127.0.0.1:a")?;
    let b = engine(&url, "127.0.0.1:b")?;
    let (lease, _) = etcd.grant(Duration::from_secs(30), soon())?;

    // "ghost" points at b's address with another engine id: b is not that engine.
    let ghost = SegmentDescriptor {
        name: "ghost".into(),
        rpc: b.rpc_name().into(),
        engine_id: b.transport().id() ^ 1,
        backend: "tcp".into(),
    };
    etcd.create_with_lease(&segment_key("", "ghost"), &ghost.encode(), lease, soon())?;
    let e = a.open_segment("ghost", false).expect_err("ghost");
    assert_eq!(e.code(), Code::Socket, "{e}");
    assert!(e.to_string().contains("another one answers"), "{e}");

    // Bytes that are not a descriptor, and one published under another name.
    etcd.create_with_lease(&segment_key("", "junk"), b"\xff\x00junk", lease, soon())?;
    let e = a.open_segment("junk", false).expect_err("junk");
    assert_eq!(e.code(), Code::Metadata, "{e}");
    let mut other = ghost.clone();
    other.name = "someone-else".into();
    etcd.create_with_lease(&segment_key("", "renamed"), &other.encode(), lease, soon())?;
    assert_eq!(code(a.open_segment("renamed", false)), Code::Metadata);

    // A real name still works afterwards.
    assert!(a.open_segment("127.0.0.1:b", false)? > 0);
    Ok(())
}

#[test]
fn etcd_down_or_stopped_fails_within_the_deadline() -> Result<()> {
    // Nobody listens: refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let t = Instant::now();
    let e = new_engine(&format!("etcd://127.0.0.1:{port}"), "127.0.0.1:x", opts())
        .expect_err("no etcd");
    assert_eq!(e.code(), Code::Metadata, "{e}");
    assert!(e.directory_error().is_some(), "{e:?}");
    ensure!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );

    // A stopped member accepts connections and never answers: the handshake timeout
    // (2 s here) bounds the start.
    let cluster = EtcdCluster::start(1);
    let url = cluster.url();
    let live = engine(&url, "127.0.0.1:live")?;
    cluster.pause(0);
    let t = Instant::now();
    let e = new_engine(&url, "127.0.0.1:y", opts()).expect_err("stopped etcd");
    let took = t.elapsed();
    assert_eq!(e.code(), Code::Metadata, "{e}");
    ensure!(took < Duration::from_secs(4), "took {took:?}");
    // Opening a name and closing an engine are bounded too.
    let t = Instant::now();
    assert_eq!(code(live.open_segment("z", false)), Code::Metadata);
    live.close();
    ensure!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
    cluster.resume(0);

    // Malformed addresses are the caller's mistake.
    assert_eq!(
        code(new_engine("etcd://", "x", opts())),
        Code::InvalidArgument
    );
    assert_eq!(
        code(new_engine("etcd://h:99999", "x", opts())),
        Code::InvalidArgument
    );
    assert_eq!(
        code(new_engine("bogus://x", "x", opts())),
        Code::InvalidArgument
    );
    Ok(())
}

#[test]
fn a_name_lost_with_its_lease_is_published_again() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let url = cluster.url();
    let etcd = Etcd::connect(&url, soon())?;
    let a = engine(&url, "127.0.0.1:comeback")?;
    let key = segment_key("", "127.0.0.1:comeback");
    // etcd stopped for longer than the lease (5 s): on resumption it expires the lease
    // and the key, and the engine's renewal finds its lease gone.
    cluster.pause(0);
    std::thread::sleep(Duration::from_secs(7));
    cluster.resume(0);
    let t = Instant::now();
    let mut gone_seen = false;
    loop {
        let present = etcd.get(&key, soon())?.is_some();
        gone_seen |= !present;
        if present && gone_seen {
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(15),
            "not published again (gone seen: {gone_seen})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("published again {:?} after etcd resumed", t.elapsed());
    let b = engine(&url, "127.0.0.1:other")?;
    assert!(b.open_segment("127.0.0.1:comeback", false)? > 0);
    drop(a);
    ensure!(etcd.get(&key, soon())?.is_none(), "withdrawn on close");
    Ok(())
}
