//! A standalone store client (`RealClient`) and dummy clients: two dummies share the real
//! client's segment and engine, put and get through shared memory (bytes checked), and
//! the dummy endpoint holds against hostile peers (wrong token, no hello, garbage,
//! oversized frames, spans outside the mapping, a map without a descriptor, too many
//! connections). TCP on 127.0.0.1 between the real client and the store.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{client_cfg, fill};
use pagewire_store::ipc::{self, IpcItem, IpcRequest, IpcResponse, ShmSpan};
use pagewire_store::{
    Code, DummyClient, DummyConfig, IpcAddr, Master, MasterConfig, PutOptions, RealClient,
    RealClientConfig, SharedBuf, Span, StoreClient, StoreError,
};
use pagewire_transport::BackendKind;

const TOKEN: &str = "standalone-secret";

/// A unique abstract address per test.
fn addr() -> IpcAddr {
    static N: AtomicU32 = AtomicU32::new(0);
    IpcAddr::Abstract(format!(
        "pagewire-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

struct Setup {
    _master: Master,
    real: RealClient,
}

fn setup(max_dummies: usize) -> Result<Setup> {
    let master = Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        token: Some(TOKEN.as_bytes().to_vec()),
        ..MasterConfig::default()
    })?;
    let mut c = client_cfg(&master.local_addr().to_string(), BackendKind::Tcp, 32 << 20);
    c.token = Some(TOKEN.into());
    let store = StoreClient::connect(c)?;
    // No token here: the real client takes the store client's.
    let mut rc = RealClientConfig::new(addr());
    rc.max_dummies = max_dummies;
    Ok(Setup {
        _master: master,
        real: RealClient::start(store, rc)?,
    })
}

fn dummy(s: &Setup, token: Option<&str>) -> Result<DummyClient, StoreError> {
    let mut c = DummyConfig::new(s.real.address().clone());
    c.token = token.map(str::to_string);
    c.timeout = Duration::from_secs(10);
    DummyClient::connect(c)
}

#[test]
fn two_dummies_put_and_get_through_shared_memory() -> Result<()> {
    let s = setup(8)?;
    let page = 64 << 10;
    let keys: Vec<String> = (0..8).map(|i| format!("h{i}_0_k")).collect();

    // Dummy A writes 8 pages from its pool (one shared buffer, registered once).
    let a = dummy(&s, Some(TOKEN))?;
    let pool = SharedBuf::new(keys.len() * page)?;
    let mut want = vec![0u8; page];
    for (i, k) in keys.iter().enumerate() {
        fill(k, 3, &mut want);
        pool.write((i * page) as u64, &want)?;
    }
    a.register_buffer(pool.addr(), pool.len())?;
    a.register_buffer(pool.addr() + 10, 100)?; // the same buffer again: nothing to do
    let parts: Vec<[Span; 1]> = (0..keys.len())
        .map(|i| [Span::new(pool.addr() + (i * page) as u64, page as u64)])
        .collect();
    let r = a.put(&keys, &parts, &PutOptions::default())?;
    ensure!(r.iter().all(|x| x.is_ok()), "{r:?}");
    // The first write wins, as with an embedded client.
    let again = a.put(&keys[..1], &parts[..1], &PutOptions::default())?;
    ensure!(again == [Err(Code::AlreadyExists)], "{again:?}");

    // Dummy B, another connection with its own memory, reads them back byte-exact.
    let b = std::thread::spawn(move || -> Result<()> {
        let b = dummy(&s, Some(TOKEN))?;
        ensure!(s.real.dummies() == 2, "{} dummies", s.real.dummies());
        let dst = SharedBuf::new(keys.len() * page + 4096)?;
        b.register_buffer(dst.addr(), dst.len())?;
        let parts: Vec<[Span; 2]> = (0..keys.len())
            .map(|i| {
                let at = dst.addr() + (i * page) as u64;
                // Two spans per object: scatter works across them.
                [
                    Span::new(at, 4096),
                    Span::new(at + 4096, (page - 4096) as u64),
                ]
            })
            .collect();
        let r = b.get(&keys, &parts)?;
        ensure!(r.iter().all(|x| *x == Ok(page as u64)), "{r:?}");
        let mut got = vec![0u8; page];
        let mut want = vec![0u8; page];
        for (i, k) in keys.iter().enumerate() {
            dst.read((i * page) as u64, &mut got)?;
            fill(k, 3, &mut want);
            ensure!(got == want, "{k}: bytes differ");
        }
        ensure!(b.exist(&[keys[0].as_str(), "nope"])? == [Ok(true), Ok(false)]);
        ensure!(b.size(&[keys[1].as_str(), "nope"])? == [Ok(page as u64), Err(Code::NotFound)]);
        // A destination outside B's registered memory is refused per key; the rest go.
        let stray = vec![0u8; page];
        let r = b.get(
            &[&keys[0], &keys[1]],
            &[
                [Span::new(stray.as_ptr() as u64, page as u64)],
                [Span::new(dst.addr(), page as u64)],
            ],
        )?;
        ensure!(r == [Err(Code::InvalidParams), Ok(page as u64)], "{r:?}");
        // Too small a destination.
        let r = b.get(&keys[..1], &[[Span::new(dst.addr(), 100)]])?;
        ensure!(r == [Err(Code::InvalidParams)], "{r:?}");
        ensure!(b.remove(&keys[..2], true)? == [Code::Ok, Code::Ok]);
        ensure!(b.exist(&keys[..1])? == [Ok(false)]);
        ensure!(b.real_endpoint()? == s.real.store().endpoint());
        b.ping()?;
        b.unregister_buffer(dst.addr())?;
        let r = b.get(&keys[2..3], &[[Span::new(dst.addr(), page as u64)]])?;
        ensure!(r == [Err(Code::InvalidParams)], "unregistered: {r:?}");
        ensure!(b.remove_all(true)? == (keys.len() - 2) as u64);
        b.close();
        ensure!(matches!(b.ping(), Err(StoreError::Shutdown)));
        // The real client lets go of B's connection and mappings.
        let t0 = Instant::now();
        while s.real.dummies() > 1 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        ensure!(
            s.real.dummies() == 1,
            "{} dummies after close",
            s.real.dummies()
        );
        Ok(())
    });
    b.join().expect("dummy B")?;
    // Memory that is not shared is refused at registration.
    let plain = vec![0u8; 4096];
    ensure!(matches!(
        a.register_buffer(plain.as_ptr() as u64, 4096),
        Err(StoreError::InvalidArgument { .. })
    ));
    a.close();
    Ok(())
}

#[test]
fn a_dummy_without_the_token_is_refused() -> Result<()> {
    let s = setup(8)?;
    // A dummy endpoint token other than the store client's is refused at start.
    let mut rc = RealClientConfig::new(addr());
    rc.token = Some("another".into());
    ensure!(matches!(
        RealClient::start(s.real.store().clone(), rc),
        Err(StoreError::Config { .. })
    ));
    for token in [None, Some("guess")] {
        match dummy(&s, token) {
            Err(StoreError::Rejected {
                code: Code::Unauthorized,
                ..
            }) => {}
            other => anyhow::bail!("token {token:?}: {other:?}"),
        }
    }
    Ok(())
}

fn raw(s: &Setup) -> Result<UnixStream> {
    let name = match s.real.address() {
        IpcAddr::Abstract(n) => n.clone(),
        IpcAddr::Path(_) => unreachable!(),
    };
    use std::os::linux::net::SocketAddrExt;
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let c = UnixStream::connect_addr(&a)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(c)
}

fn send(c: &mut UnixStream, req: &IpcRequest) -> Result<()> {
    let mut b = Vec::new();
    req.encode(&mut b);
    c.write_all(&b)?;
    Ok(())
}

/// The next reply, or `None` when the real client closed the connection.
fn recv(c: &mut UnixStream) -> Result<Option<IpcResponse>> {
    let mut h = [0u8; ipc::HEADER_LEN];
    match c.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let h = ipc::decode_header(&h, ipc::MAX_FRAME)?;
    let mut body = vec![0u8; h.len as usize];
    c.read_exact(&mut body)?;
    Ok(Some(ipc::decode_response(h.kind, &body)?))
}

fn closed(c: &mut UnixStream) -> Result<bool> {
    // An error frame may come first; then the end of the stream.
    loop {
        match recv(c)? {
            None => return Ok(true),
            Some(IpcResponse::Error { .. }) => continue,
            Some(other) => anyhow::bail!("expected the end, got {other:?}"),
        }
    }
}

fn hello(s: &Setup) -> Result<UnixStream> {
    let mut c = raw(s)?;
    send(
        &mut c,
        &IpcRequest::Hello {
            token: TOKEN.as_bytes().to_vec(),
        },
    )?;
    ensure!(recv(&mut c)? == Some(IpcResponse::Codes(vec![])));
    Ok(c)
}

#[test]
fn the_dummy_endpoint_holds_against_hostile_peers() -> Result<()> {
    let s = setup(4)?;

    // Garbage first, an oversized hello, a request before hello: each closed.
    let mut c = raw(&s)?;
    c.write_all(b"GET / HTTP/1.1\r\n\r\n")?;
    ensure!(closed(&mut c)?, "garbage");
    let mut c = raw(&s)?;
    let mut h = Vec::new();
    h.extend_from_slice(&ipc::MAGIC);
    h.extend_from_slice(&ipc::VERSION.to_le_bytes());
    h.extend_from_slice(&[1, 0]);
    h.extend_from_slice(&(64u32 << 20).to_le_bytes());
    c.write_all(&h)?;
    ensure!(closed(&mut c)?, "oversized hello");
    let mut c = raw(&s)?;
    send(&mut c, &IpcRequest::Ping)?;
    ensure!(closed(&mut c)?, "request before hello");

    // A peer that says nothing is dropped after the hello deadline.
    let mut c = raw(&s)?;
    let t0 = Instant::now();
    ensure!(closed(&mut c)?, "silent peer");
    ensure!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());

    // Authenticated, then: a map without a descriptor, spans outside any region or past
    // one's end are refused, and the connection goes on.
    let mut c = hello(&s)?;
    send(&mut c, &IpcRequest::Map { size: 4096 })?;
    ensure!(matches!(
        recv(&mut c)?,
        Some(IpcResponse::Error {
            code: Code::InvalidParams,
            ..
        })
    ));
    let item = |region, offset, len| IpcItem {
        key: b"k".to_vec(),
        parts: vec![ShmSpan {
            region,
            offset,
            len,
        }],
    };
    send(
        &mut c,
        &IpcRequest::Get {
            items: vec![item(1, 0, 4096), item(77, 1 << 40, 4096)],
        },
    )?;
    let r = recv(&mut c)?;
    ensure!(r == Some(IpcResponse::Codes(vec![-600, -600])), "{r:?}");
    send(&mut c, &IpcRequest::Unmap { region: 3 })?;
    ensure!(matches!(recv(&mut c)?, Some(IpcResponse::Error { .. })));
    send(&mut c, &IpcRequest::Ping)?;
    ensure!(recv(&mut c)? == Some(IpcResponse::Codes(vec![0])));
    // A frame of an unknown kind ends it.
    let mut bad = Vec::new();
    IpcRequest::Ping.encode(&mut bad);
    bad[6] = 0x55;
    c.write_all(&bad)?;
    ensure!(closed(&mut c)?, "unknown kind");

    // Connections are bounded: with 4 held, the fifth is closed at once.
    let held: Vec<UnixStream> = (0..4).map(|_| hello(&s)).collect::<Result<_>>()?;
    let mut fifth = raw(&s)?;
    ensure!(closed(&mut fifth)?, "fifth connection");
    drop(held);
    let t0 = Instant::now();
    while s.real.dummies() > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    ensure!(s.real.dummies() == 0);
    // And a real dummy works again afterwards.
    dummy(&s, Some(TOKEN))?.ping()?;
    Ok(())
}

/// The real client goes away (shutdown ends its dummies' connections) and another takes
/// its address: the dummy's next call fails, the one after connects again, maps its
/// buffer anew, and puts and gets work with the same registered memory.
#[test]
fn a_dummy_reconnects_to_a_new_real_client() -> Result<()> {
    let s = setup(8)?;
    let d = dummy(&s, Some(TOKEN))?;
    let buf = SharedBuf::new(2 * 4096)?;
    buf.write(0, &[7u8; 4096])?;
    d.register_buffer(buf.addr(), buf.len())?;
    let span = |off: u64| [Span::new(buf.addr() + off, 4096)];
    ensure!(d.put(&["before"], &[span(0)], &PutOptions::default())? == [Ok(())]);

    let store = s.real.store().clone();
    let mut rc = RealClientConfig::new(s.real.address().clone());
    rc.token = Some(TOKEN.into());
    s.real.shutdown();
    let t0 = Instant::now();
    while s.real.dummies() > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    ensure!(
        s.real.dummies() == 0,
        "shutdown left {} dummies",
        s.real.dummies()
    );
    let again = RealClient::start(store, rc)?;
    // The call that finds the connection gone fails; the next one reconnects.
    let first = d.ping();
    ensure!(first.is_err(), "{first:?}");
    d.ping()?;
    ensure!(again.dummies() == 1);
    buf.write(0, &[9u8; 4096])?;
    ensure!(d.put(&["after"], &[span(0)], &PutOptions::default())? == [Ok(())]);
    ensure!(
        d.get(&["before", "after"], &[span(4096), span(4096)])?
            .len()
            == 2
    );
    ensure!(d.get(&["after"], &[span(4096)])? == [Ok(4096)]);
    let mut got = [0u8; 4096];
    buf.read(4096, &mut got)?;
    ensure!(got == [9u8; 4096]);
    ensure!(d.get(&["before"], &[span(4096)])? == [Ok(4096)]);
    buf.read(4096, &mut got)?;
    ensure!(got == [7u8; 4096]);
    d.close();
    ensure!(matches!(d.ping(), Err(StoreError::Shutdown)));
    Ok(())
}

/// Run by `a_peer_of_another_user_is_refused_even_with_the_token` in a child process of
/// another user id (`PW_PROBE_ADDR` set): a peer that knows the token is still refused by
/// the real client, and a dummy refuses to talk to a real client of another user id.
/// Without the variable it does nothing.
#[test]
fn other_user_probe() {
    let Ok(name) = std::env::var("PW_PROBE_ADDR") else {
        return;
    };
    // By hand, past the dummy's own check: the server refuses before reading the hello.
    use std::os::linux::net::SocketAddrExt;
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut raw = UnixStream::connect_addr(&a).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = send(
        &mut raw,
        &IpcRequest::Hello {
            token: TOKEN.as_bytes().to_vec(),
        },
    );
    match recv(&mut raw) {
        Ok(Some(IpcResponse::Error {
            code: Code::Unauthorized,
            message,
        })) => assert!(message.contains("user id"), "{message}"),
        other => panic!("the real client answered another user id with {other:?}"),
    }
    // The dummy's side: it will not hand the token to a server of another user id.
    let mut c = DummyConfig::new(IpcAddr::Abstract(name));
    c.token = Some(TOKEN.into());
    match DummyClient::connect(c) {
        Err(StoreError::Rejected {
            code: Code::Unauthorized,
            ..
        }) => {}
        other => panic!("a dummy of another user id got {other:?}"),
    }
}

/// The dummy endpoint serves its own user id only (`SO_PEERCRED`): a process of another
/// user that presents the right token is refused. Needs root to start that process
/// (`setuid` 65534); as another user it says so and checks nothing.
#[test]
fn a_peer_of_another_user_is_refused_even_with_the_token() -> Result<()> {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: cannot start a process of another user id; nothing checked");
        return Ok(());
    }
    let s = setup(4)?;
    let IpcAddr::Abstract(name) = s.real.address().clone() else {
        unreachable!()
    };
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "other_user_probe",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PW_PROBE_ADDR", &name)
        .uid(65534)
        .gid(65534)
        .output()?;
    ensure!(
        out.status.success(),
        "probe: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the probe did not run: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Our own user with the token is served.
    dummy(&s, Some(TOKEN))?.ping()?;
    Ok(())
}
