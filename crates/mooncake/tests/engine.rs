//! The engine's rules between two engines on 127.0.0.1 (TCP): registration overlaps,
//! segments, batch ids and their status transitions, all-or-nothing submits, Mooncake's
//! codes for each bad input, and the bytes on the receiving side.

use std::time::{Duration, Instant};

use pagewire_mooncake::{
    BatchCheck, Code, LOCAL_SEGMENT, Opcode, Options, Request, Transfer, TransferEngine,
    TransferStatus,
};

fn engine() -> TransferEngine {
    let opts = Options {
        protocol: Some("tcp".into()),
        transfer_timeout: Duration::from_secs(5),
        ..Options::default()
    };
    TransferEngine::new("P2PHANDSHAKE", "127.0.0.1", opts).expect("engine")
}

/// A page-aligned heap buffer that both engines may outlive only after closing.
struct Buf(Vec<u8>);

impl Buf {
    fn new(n: usize, seed: u8) -> Buf {
        Buf((0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect())
    }
    fn zeroed(n: usize) -> Buf {
        Buf(vec![0; n])
    }
    fn addr(&mut self) -> u64 {
        self.0.as_mut_ptr() as u64
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, pagewire_mooncake::Error>) -> Code {
    r.expect_err("should fail").code()
}

fn wait_done(e: &TransferEngine, batch: u64, task: usize) -> TransferStatus {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = e.task_status(batch, task).unwrap().status;
        if s != TransferStatus::Waiting || Instant::now() > until {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn registration_follows_mooncakes_overlap_rules() {
    let e = engine();
    let mut b = Buf::new(1 << 16, 1);
    let a = b.addr();
    // SAFETY: `b` outlives the engine's registrations (the engine closes first).
    unsafe {
        e.register(a, 1 << 16, true).unwrap();
        assert_eq!(
            code(e.register(a, 1 << 16, true)),
            Code::AddressOverlapped,
            "twice"
        );
        assert_eq!(
            code(e.register(a + 4096, 4096, true)),
            Code::AddressOverlapped,
            "inside"
        );
        assert_eq!(
            code(e.register(a - 10, 20, true)),
            Code::AddressOverlapped,
            "start"
        );
        assert_eq!(
            code(e.register(a + (1 << 16) - 1, 2, true)),
            Code::AddressOverlapped,
            "end"
        );
        assert_eq!(
            code(e.register(a, 0, true)),
            Code::InvalidArgument,
            "zero length"
        );
        assert_eq!(code(e.register(0, 16, true)), Code::InvalidArgument, "null");
        assert_eq!(
            code(e.register(8, 4096, true)),
            Code::InvalidArgument,
            "not memory"
        );
        assert_eq!(
            code(e.register(u64::MAX - 8, 16, true)),
            Code::InvalidArgument,
            "overflow"
        );
    }
    assert_eq!(
        code(e.unregister(a + 4096)),
        Code::AddressNotRegistered,
        "not the start"
    );
    e.unregister(a).unwrap();
    assert_eq!(code(e.unregister(a)), Code::AddressNotRegistered, "twice");
    // Batches: checked whole first, then all or nothing.
    let mut c = Buf::new(8192, 2);
    let ca = c.addr();
    // SAFETY: `b` and `c` outlive the engine's registrations.
    unsafe {
        assert_eq!(
            code(e.register_batch(&[(a, 8192), (a + 4096, 4096)], true)),
            Code::AddressOverlapped
        );
        assert_eq!(
            code(e.register_batch(&[(a, 8192), (ca, 0)], true)),
            Code::InvalidArgument
        );
        assert_eq!(
            code(e.register_batch(&[(a, 8192), (8, 4096)], true)),
            Code::InvalidArgument
        );
        e.register(a, 8192, false)
            .expect("the failed batches left nothing behind");
        e.unregister(a).unwrap();
        e.register_batch(&[(a, 8192), (ca, 8192)], true).unwrap();
    }
    e.unregister_batch(&[a, ca]).unwrap();
    assert_eq!(
        code(e.unregister_batch(&[a, ca])),
        Code::AddressNotRegistered
    );
    e.close();
}

#[test]
fn segments_batches_and_status() {
    let (a, b) = (engine(), engine());
    let (mut src, mut pool) = (Buf::new(1 << 16, 3), Buf::zeroed(1 << 20));
    let (s, p) = (src.addr(), pool.addr());
    // SAFETY: both buffers outlive the engines (closed below).
    unsafe {
        a.register(s, 1 << 16, false).unwrap();
        b.register(p, 1 << 20, true).unwrap();
    }
    assert!(b.name().starts_with("127.0.0.1:"));
    let (lo, hi) = pagewire_mooncake::env::rpc_port_range();
    assert!((lo..=hi).contains(&b.rpc_port()));

    let seg = a.open_segment(b.name(), false).unwrap();
    assert!(seg > LOCAL_SEGMENT);
    assert_eq!(
        a.open_segment(b.name(), false).unwrap(),
        seg,
        "cached by name"
    );
    assert_eq!(
        a.open_segment(b.name(), true).unwrap(),
        seg,
        "no-cache: same id"
    );
    assert_eq!(a.open_segment(a.name(), false).unwrap(), LOCAL_SEGMENT);
    assert_eq!(
        code(a.open_segment("no-port", false)),
        Code::InvalidArgument
    );
    assert_eq!(code(a.open_segment("127.0.0.1:1", false)), Code::Socket);

    let w = |off: u64, len: u64| Request {
        opcode: Opcode::Write,
        source: s,
        target_id: seg,
        target_offset: p + off,
        length: len,
    };
    assert_eq!(code(a.allocate_batch(0)), Code::InvalidArgument);
    let batch = a.allocate_batch(3).unwrap();
    assert_ne!(batch, 0);
    assert_ne!(batch, u64::MAX);
    assert_eq!(
        code(a.task_status(batch, 0)),
        Code::InvalidArgument,
        "no task yet"
    );
    // Refused submits add no task and move nothing.
    let mut bad = w(0, 4096);
    bad.source = s + (1 << 16) - 100;
    assert_eq!(
        code(a.submit(batch, &[w(0, 16), bad], None)),
        Code::AddressNotRegistered
    );
    assert_eq!(
        code(a.submit(batch, &[w(0, 16), w((1 << 20) - 10, 16)], None)),
        Code::AddressNotRegistered,
        "one good, one bad remote"
    );
    let mut far = w(0, 16);
    far.target_offset = u64::MAX - 4;
    assert_eq!(
        code(a.submit(batch, &[far], None)),
        Code::InvalidArgument,
        "overflow"
    );
    let mut nowhere = w(0, 16);
    nowhere.target_id = 4242;
    assert_eq!(
        code(a.submit(batch, &[nowhere], None)),
        Code::InvalidArgument
    );
    assert_eq!(
        code(a.submit(batch, &[w(0, 1); 4], None)),
        Code::TooManyRequests
    );
    assert_eq!(code(a.task_status(batch, 0)), Code::InvalidArgument);

    a.submit(batch, &[w(100, 4096), w(9000, 0)], None).unwrap();
    assert_eq!(wait_done(&a, batch, 0), TransferStatus::Completed);
    let st = a.task_status(batch, 0).unwrap();
    assert_eq!(st.transferred_bytes, 4096);
    assert_eq!(
        a.task_status(batch, 1).unwrap().status,
        TransferStatus::Completed,
        "empty"
    );
    assert_eq!(code(a.task_status(batch, 2)), Code::InvalidArgument);
    assert_eq!(
        code(a.submit(batch, &[w(0, 1); 2], None)),
        Code::TooManyRequests
    );
    a.free_batch(batch).unwrap();
    assert_eq!(
        code(a.free_batch(batch)),
        Code::InvalidArgument,
        "double free"
    );
    assert_eq!(
        code(a.task_status(batch, 0)),
        Code::InvalidArgument,
        "freed"
    );
    assert_eq!(
        code(a.free_batch(b.allocate_batch(1).unwrap())),
        Code::InvalidArgument,
        "other engine's id"
    );

    // A batch id is not reused.
    let again = a.allocate_batch(1).unwrap();
    assert_ne!(again, batch);
    a.free_batch(again).unwrap();

    // The Python binding's async ids: running, then collected once.
    let id = a
        .transfer_async(&Transfer::write(b.name(), &[s], &[p + 8192], &[1 << 16]))
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    let mut st = a.check_batch(id);
    while st == BatchCheck::Running && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
        st = a.check_batch(id);
    }
    assert_eq!(st, BatchCheck::Completed);
    assert_eq!(a.check_batch(id), BatchCheck::Failed, "collected");
    let ids = [
        a.transfer_async(&Transfer::write(b.name(), &[s], &[p], &[64]))
            .unwrap(),
        a.transfer_async(&Transfer::write(b.name(), &[], &[], &[]))
            .unwrap(),
    ];
    a.wait_batches(&ids).unwrap();
    assert_eq!(
        code(a.wait_batches(&ids)),
        Code::InvalidArgument,
        "collected"
    );
    assert_eq!(
        code(a.transfer_async(&Transfer::write(b.name(), &[s], &[8], &[64]))),
        Code::AddressNotRegistered,
        "refused at submission"
    );
    assert_eq!(
        code(a.transfer_async(&Transfer::write(b.name(), &[s], &[p], &[]))),
        Code::InvalidArgument
    );

    a.close();
    b.close();
    let (src, pool) = (&src.0, &pool.0);
    assert_eq!(&pool[100..4196], &src[..4096]);
    assert_eq!(&pool[8192..8192 + (1 << 16)], &src[..]);
    assert!(
        pool[(1 << 20) - 10..].iter().all(|&x| x == 0),
        "the refused half moved nothing"
    );
}

#[test]
fn sync_transfers_notifications_and_probes() {
    let (a, b) = (engine(), engine());
    let (mut src, mut pool) = (Buf::new(1 << 16, 5), Buf::zeroed(1 << 16));
    let (s, p) = (src.addr(), pool.addr());
    // SAFETY: both buffers outlive the engines (closed below).
    unsafe {
        a.register(s, 1 << 16, true).unwrap();
        b.register(p, 1 << 16, true).unwrap();
    }
    let sid = b.name().to_owned();
    a.transfer_sync(
        &Transfer::write(&sid, &[s, s + 4096], &[p + 8192, p], &[4096, 4096]),
        None,
    )
    .unwrap();
    a.transfer_sync(&Transfer::read(&sid, &[s + 32768], &[p], &[4096]), None)
        .unwrap();
    // Notifications: after the data, once each, also alone.
    for i in 0..3u8 {
        let msg = vec![b'0' + i; 2000 * usize::from(i)];
        a.transfer_sync(
            &Transfer::write(&sid, &[s], &[p + 100], &[10]),
            Some((b"n", &msg)),
        )
        .unwrap();
    }
    a.transfer_sync(
        &Transfer::write(&sid, &[], &[], &[]),
        Some((b"only", b"tag")),
    )
    .unwrap();
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while got.len() < 4 && Instant::now() < until {
        got.extend(b.take_notifications());
        std::thread::sleep(Duration::from_millis(2));
    }
    let lens: Vec<(Vec<u8>, usize)> = got.iter().map(|(n, m)| (n.clone(), m.len())).collect();
    assert_eq!(
        lens,
        vec![
            (b"n".to_vec(), 0),
            (b"n".to_vec(), 2000),
            (b"n".to_vec(), 4000),
            (b"only".to_vec(), 3)
        ]
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(b.take_notifications().is_empty());
    // Bad input: the code, and nothing moved.
    let big = vec![0u8; pagewire_mooncake::MAX_NOTIFY_BYTES + 1];
    assert_eq!(
        code(a.transfer_sync(&Transfer::write(&sid, &[s], &[p], &[1]), Some((b"", &big)))),
        Code::InvalidArgument
    );
    assert_eq!(
        code(a.transfer_sync(
            &Transfer::write(&sid, &[s], &[p + (1 << 16) - 1], &[2]),
            None
        )),
        Code::AddressNotRegistered
    );
    assert_eq!(
        code(a.transfer_sync(&Transfer::write("127.0.0.1", &[s], &[p], &[1]), None)),
        Code::InvalidArgument
    );
    assert_eq!(
        code(a.transfer_sync(&Transfer::write(&sid, &[s], &[p], &[]), None)),
        Code::InvalidArgument
    );
    // A buffer the peer registers after the session opened is found.
    let mut late = Buf::zeroed(4096);
    let l = late.addr();
    // SAFETY: `late` outlives the engines.
    unsafe { b.register(l, 4096, true).unwrap() };
    a.transfer_sync(&Transfer::write(&sid, &[s], &[l], &[4096]), None)
        .unwrap();
    assert_eq!(a.first_buffer_address(&sid).unwrap(), p.min(l));
    // Probes: Mooncake's codes.
    a.send_probe(&sid).unwrap();
    assert_eq!(code(a.send_probe("127.0.0.1")), Code::Metadata);
    assert_eq!(code(a.send_probe("127.0.0.1:1")), Code::Socket);
    assert_eq!(code(a.send_probe("no-such-host.invalid:15000")), Code::Dns);
    a.close();
    b.close();
    assert_eq!(&pool.0[8192..12288], &src.0[..4096]);
    assert_eq!(&src.0[32768..36864], &src.0[4096..8192], "read back");
    assert_eq!(&late.0[..], &src.0[..4096]);
}

/// A peer that connected to an engine and went away is disconnected by the engine's
/// notification thread (the transport keeps a broken peer listed until then), so an
/// engine many short-lived peers connect to does not accumulate them.
#[test]
fn broken_accepted_connections_are_forgotten() {
    let b = engine();
    for _ in 0..3 {
        let a = engine();
        a.open_segment(b.name(), false).unwrap();
        a.close();
    }
    let until = Instant::now() + Duration::from_secs(10);
    while !b.transport().peers().is_empty() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        b.transport().peers(),
        vec![],
        "broken accepted peers still listed"
    );
    b.close();
}

/// Managed buffers: registered memory a peer writes into, Mooncake's block order, the
/// byte helpers only inside registered memory, a refused bogus free, and a large buffer
/// unregistered by its free.
#[test]
fn managed_buffers() {
    let (a, b) = (engine(), engine());
    let first = a.allocate_managed(100).unwrap();
    let second = a.allocate_managed(8192).unwrap();
    assert_eq!(first - second, 8192);
    let chunk = b.first_buffer_address(a.name()).unwrap();
    assert_eq!(first, chunk + pagewire_mooncake::MANAGED_CHUNK_BYTES - 8192);

    let mut src = Buf::new(4096, 7);
    // SAFETY: `src` outlives `b` (closed below).
    unsafe { b.register(src.addr(), 4096, false) }.unwrap();
    let (locals, remotes, lens) = ([src.addr()], [first], [4096]);
    b.transfer_sync(&Transfer::write(a.name(), &locals, &remotes, &lens), None)
        .unwrap();
    assert_eq!(a.read_local(first, 4096).unwrap(), src.0);

    a.write_local(first, b"abc").unwrap();
    assert_eq!(a.read_local(first, 3).unwrap(), b"abc");
    let mut stray = Buf::zeroed(64);
    assert_eq!(
        code(a.write_local(stray.addr(), b"abc")),
        Code::AddressNotRegistered
    );
    assert_eq!(
        code(a.read_local(stray.addr(), 3)),
        Code::AddressNotRegistered
    );
    // Past the end of the chunk (the first block is its last 8 KiB).
    assert_eq!(
        code(a.read_local(first + 8190, 3)),
        Code::AddressNotRegistered
    );

    assert_eq!(
        code(a.free_managed(stray.addr(), 100)),
        Code::InvalidArgument
    );
    assert_eq!(
        code(a.free_managed(first, 300 << 20)),
        Code::InvalidArgument
    );
    a.free_managed(first, 100).unwrap();
    assert_eq!(code(a.free_managed(first, 100)), Code::InvalidArgument);
    assert_eq!(a.allocate_managed(1).unwrap(), first); // LIFO reuse

    let big = a.allocate_managed(300 << 20).unwrap();
    a.write_local(big + (300 << 20) - 1, b"z").unwrap();
    a.free_managed(big, 300 << 20).unwrap();
    assert_eq!(code(a.write_local(big, b"z")), Code::AddressNotRegistered);
    b.close();
    a.close();
    assert_eq!(code(a.allocate_managed(1)), Code::Context);
}
