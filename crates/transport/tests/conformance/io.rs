//! The conformance suite's tests that need real threads or sockets, so they run on the
//! real backends only (`tests/conformance.rs`), not on the simulated pair:
//! `blocked_poster_does_not_starve_others` (its subject is a second thread blocked in
//! `submit`), `hostile_handshakes` and `handshake_flood` (raw bytes and half-open TCP
//! connections on the control port), `token_refusals_are_counted` (a real engine's
//! counter).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_transport::{Access, BackendKind, Batch, Error, HandshakeError, Op, TransferOp};

use crate::common::*;

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

/// Every control connection refused for its token (wrong or missing) is counted on the
/// acceptor by the time the initiator has its `TokenMismatch`; none becomes a peer, and a
/// right token still connects (and is not counted).
pub fn token_refusals_are_counted(kind: BackendKind) -> Result<()> {
    let b = engine_with(config(kind).token("sesame"))?;
    for i in 0..5u64 {
        let stranger = if i % 2 == 0 {
            engine(kind)?
        } else {
            engine_with(config(kind).token(format!("guess{i}")))?
        };
        match stranger.connect(b.local_addr()) {
            Err(Error::Handshake(HandshakeError::TokenMismatch)) => {}
            other => bail!("stranger {i}: {other:?}"),
        }
        ensure!(b.token_refusals() == i + 1, "{}", b.token_refusals());
    }
    ensure!(b.peers().is_empty(), "{:?}", b.peers());
    let right = engine_with(config(kind).token("sesame"))?;
    connect(&right, &b)?;
    ensure!(b.token_refusals() == 5 && b.peers().len() == 1);
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
