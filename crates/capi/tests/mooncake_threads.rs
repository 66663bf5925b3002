//! The Mooncake entry points under concurrent use and misuse, called from Rust (as C
//! would): several threads submit, poll and free batches on one engine while another
//! feeds it made-up and freed ids; many notifications (more than the outbox has slots)
//! arrive complete and in order; a peer destroyed mid-use turns into error codes.
//! Backend: `PAGEWIRE_TRANSPORT` (TCP on the host).

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use transfer_engine::mooncake::*;

/// A `transfer_engine_t` that may cross threads (the library is thread-safe).
#[derive(Clone, Copy)]
struct Te(transfer_engine_t);
// SAFETY: the handle is a table token; every entry point may be called from any thread.
unsafe impl Send for Te {}
// SAFETY: as above.
unsafe impl Sync for Te {}

impl Te {
    /// The handle (a method, so that closures capture the `Send` wrapper, not the field).
    fn raw(self) -> transfer_engine_t {
        self.0
    }
}

fn create() -> Te {
    // SAFETY: NUL-terminated literals.
    let e = unsafe {
        createTransferEngine(
            c"P2PHANDSHAKE".as_ptr(),
            c"127.0.0.1".as_ptr(),
            c"".as_ptr(),
            0,
            1,
        )
    };
    assert!(!e.is_null(), "createTransferEngine: {}", last_error());
    Te(e)
}

fn last_error() -> String {
    let p = transfer_engine::pagewire::pw_last_error();
    if p.is_null() {
        return "none".into();
    }
    // SAFETY: a NUL-terminated string valid until this thread's next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn name(e: Te) -> [c_char; 64] {
    let mut buf = [0 as c_char; 64];
    // SAFETY: `buf` holds 64 bytes.
    let rc = unsafe { getLocalIpAndPort(e.raw(), buf.as_mut_ptr(), buf.len()) };
    assert_eq!(rc, 0);
    buf
}

/// Polls every task until none is pending (10 s at most); returns the statuses.
fn wait(e: Te, batch: u64, n: usize) -> Vec<i32> {
    let until = Instant::now() + Duration::from_secs(10);
    (0..n)
        .map(|t| {
            loop {
                let mut st = transfer_status {
                    status: -1,
                    transferred_bytes: 0,
                };
                // SAFETY: `st` is writable.
                let rc = unsafe { getTransferStatus(e.raw(), batch, t, &mut st) };
                assert_eq!(rc, 0, "getTransferStatus: {}", last_error());
                if st.status != STATUS_WAITING && st.status != STATUS_PENDING {
                    break st.status;
                }
                assert!(Instant::now() < until, "task {t} pending after 10 s");
                std::thread::yield_now();
            }
        })
        .collect()
}

#[test]
fn concurrent_batches_and_bad_ids() {
    let (a, b) = (create(), create());
    const PER: usize = 64 << 10;
    const THREADS: usize = 4;
    let mut pool = vec![0u8; PER * THREADS];
    let mut src = vec![0u8; PER * THREADS];
    for (i, x) in src.iter_mut().enumerate() {
        *x = (i * 7 + i / 251) as u8;
    }
    let pool_addr = pool.as_mut_ptr() as u64;
    // SAFETY: both buffers outlive the engines (destroyed at the end of the test).
    unsafe {
        assert_eq!(
            registerLocalMemory(
                b.raw(),
                pool.as_mut_ptr().cast(),
                pool.len(),
                c"*".as_ptr(),
                1
            ),
            0
        );
        assert_eq!(
            registerLocalMemory(
                a.raw(),
                src.as_mut_ptr().cast(),
                src.len(),
                c"*".as_ptr(),
                0
            ),
            0
        );
    }
    let seg_name = name(b);
    // SAFETY: a NUL-terminated name.
    let seg = unsafe { openSegment(a.raw(), seg_name.as_ptr()) };
    assert!(seg > 0, "openSegment: {}", last_error());
    let src_addr = src.as_ptr() as u64;
    let stop = AtomicBool::new(false);

    std::thread::scope(|s| {
        // Misuse from another thread all along: never a crash, always an error.
        s.spawn(|| {
            let mut st = transfer_status {
                status: 0,
                transferred_bytes: 0,
            };
            let mut k = 1u64;
            while !stop.load(Ordering::Relaxed) {
                k = k
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                for id in [k, INVALID_BATCH, k & 0xffff_ffff, 0] {
                    // SAFETY: valid out-pointer; the ids are made up on purpose.
                    unsafe {
                        assert_eq!(getTransferStatus(a.raw(), id, 0, &mut st), 1);
                        assert_eq!(freeBatchID(a.raw(), id), 1);
                    }
                }
                std::thread::yield_now();
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || {
                    for round in 0..50u64 {
                        let len = 1 + (round * 977 + t as u64 * 131) % PER as u64;
                        let off = (t * PER) as u64;
                        // SAFETY: valid engine handle; the request names registered memory.
                        unsafe {
                            let batch = allocateBatchID(a.raw(), 2);
                            assert_ne!(batch, INVALID_BATCH);
                            let mut req = transfer_request {
                                opcode: OPCODE_WRITE,
                                source: (src_addr + off) as *mut c_void,
                                target_id: seg,
                                target_offset: pool_addr + off,
                                length: len,
                            };
                            assert_eq!(
                                submitTransfer(a.raw(), batch, &mut req, 1),
                                0,
                                "{}",
                                last_error()
                            );
                            assert_eq!(wait(a, batch, 1), [STATUS_COMPLETED]);
                            assert_eq!(freeBatchID(a.raw(), batch), 0);
                            // A freed id is dead, also for the thread that freed it.
                            assert_eq!(freeBatchID(a.raw(), batch), 1);
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker");
        }
        stop.store(true, Ordering::Relaxed);
    });
    // Each thread's last write covered at least its first bytes; the largest round of
    // each thread wrote a known prefix: check every byte that the longest write covered.
    for t in 0..THREADS {
        let longest = (0..50u64)
            .map(|r| 1 + (r * 977 + t as u64 * 131) % PER as u64)
            .max()
            .expect("rounds") as usize;
        let range = t * PER..t * PER + longest;
        assert_eq!(&pool[range.clone()], &src[range], "thread {t}'s bytes");
    }
    // SAFETY: handles from `create`; destroyed once each.
    unsafe {
        destroyTransferEngine(a.raw());
        destroyTransferEngine(b.raw());
    }
}

#[test]
fn many_notifications_arrive_in_order_and_a_destroyed_peer_is_an_error() {
    let (a, b) = (create(), create());
    let seg_name = name(b);
    // SAFETY: a NUL-terminated name.
    let seg = unsafe { openSegment(a.raw(), seg_name.as_ptr()) };
    assert!(seg > 0, "openSegment: {}", last_error());
    // More than the outbox's 256 slots: slots are reused as the receiver acknowledges.
    const N: usize = 600;
    let mut got = Vec::new();
    for i in 0..N {
        let msg = std::ffi::CString::new(format!("msg-{i}")).expect("no NUL");
        let note = notify_msg {
            name: c"sender".as_ptr().cast_mut(),
            msg: msg.as_ptr().cast_mut(),
        };
        // SAFETY: NUL-terminated strings that live through the call.
        let rc = unsafe { genNotifyInEngine(a.raw(), seg as u64, note) };
        assert_eq!(rc, 0, "{}", last_error());
        if i % 100 == 99 {
            drain(b, &mut got);
        }
    }
    let until = Instant::now() + Duration::from_secs(10);
    while got.len() < N && Instant::now() < until {
        drain(b, &mut got);
        std::thread::sleep(Duration::from_millis(1));
    }
    let want: Vec<(String, String)> = (0..N)
        .map(|i| ("sender".into(), format!("msg-{i}")))
        .collect();
    assert_eq!(got, want);

    // Too long for a slot: refused, nothing sent.
    let long = std::ffi::CString::new("x".repeat(9000)).expect("no NUL");
    let note = notify_msg {
        name: c"sender".as_ptr().cast_mut(),
        msg: long.as_ptr().cast_mut(),
    };
    // SAFETY: as above.
    assert_eq!(unsafe { genNotifyInEngine(a.raw(), seg as u64, note) }, -1);

    // The peer goes away: transfers and notifications to it fail with codes.
    let mut buf = vec![1u8; 4096];
    // SAFETY: `buf` outlives engine `a`; `b` is destroyed once.
    unsafe {
        assert_eq!(
            registerLocalMemory(
                a.raw(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                c"*".as_ptr(),
                0
            ),
            0
        );
        destroyTransferEngine(b.raw());
        let note = notify_msg {
            name: c"sender".as_ptr().cast_mut(),
            msg: c"late".as_ptr().cast_mut(),
        };
        let t0 = Instant::now();
        let rc = genNotifyInEngine(a.raw(), seg as u64, note);
        assert!(rc < 0, "notify to a destroyed peer: {rc}");
        assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
        let batch = allocateBatchID(a.raw(), 1);
        let mut req = transfer_request {
            opcode: OPCODE_WRITE,
            source: buf.as_mut_ptr().cast(),
            target_id: seg,
            target_offset: 0x1000,
            length: 16,
        };
        let rc = submitTransfer(a.raw(), batch, &mut req, 1);
        assert_ne!(rc, 0, "submit to a destroyed peer");
        assert_eq!(freeBatchID(a.raw(), batch), 0);
        destroyTransferEngine(a.raw());
    }
}

fn drain(e: Te, out: &mut Vec<(String, String)>) {
    let mut n = 0;
    // SAFETY: `n` is writable; the array is freed with its function.
    unsafe {
        let p = getNotifsFromEngine(e.raw(), &mut n);
        for i in 0..n as usize {
            let m = *p.add(i);
            out.push((
                CStr::from_ptr(m.name).to_string_lossy().into_owned(),
                CStr::from_ptr(m.msg).to_string_lossy().into_owned(),
            ));
        }
        assert_eq!(freeNotifsMsgBuf(p, n), 0);
    }
}
