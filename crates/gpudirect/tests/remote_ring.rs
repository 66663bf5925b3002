//! Staged "GPU" to "GPU" pushes between two transport engines: the sender's
//! pipeline writes into the receiver's landing ring, the receiver copies
//! host-to-device and returns credits; completion only after the last copy.

use std::thread;
use std::time::{Duration, Instant};

use pagewire_gpudirect::{
    CopyEngine, CreditBoard, GpuError, HostCopyEngine, HostFaults, RingPushWire, RingReceiver,
    Segment, StageKind, StagedPipeline, StagingConfig,
};
use pagewire_transport::BackendKind;

mod common;
use common::{engine, host_backend_tests, pattern, whole};

const T: Duration = Duration::from_secs(20);

fn push_rounds(kind: BackendKind) {
    let (Some(tx_e), Some(rx_e)) = (engine(kind), engine(kind)) else {
        return;
    };
    let cfg = StagingConfig {
        chunk_size: 24_576,
        depth: 3,
        timeout: T,
    };
    let page = 10_000usize;
    let pages = 40usize;
    let len = page * pages;

    let rx_copy = HostCopyEngine::new(HostFaults {
        delay: Duration::from_micros(100),
        ..Default::default()
    });
    let dst = rx_copy.alloc_device(len).unwrap();
    let mut rx = RingReceiver::new(rx_e.clone(), rx_copy, cfg).unwrap();
    let desc = rx.descriptor();
    let peer_tx = tx_e.connect(rx_e.local_addr()).unwrap();
    let peer_rx = rx_e
        .accept(Instant::now() + T)
        .expect("receiver sees the sender");
    let credits = CreditBoard::new(tx_e.clone(), cfg.depth).unwrap();
    let credits_addr = credits.addr();

    let tx_copy = HostCopyEngine::default();
    let src = tx_copy.alloc_device(len).unwrap();

    // Sender: pages in order. Receiver: page i lands in slot (i * 3) % pages.
    let tx_segs: Vec<Segment> = (0..pages)
        .map(|i| Segment {
            local_off: (i * page) as u64,
            remote_off: 0,
            len: page as u64,
        })
        .collect();
    let rx_segs: Vec<Segment> = (0..pages)
        .map(|i| Segment {
            local_off: ((i * 3 % pages) * page) as u64,
            remote_off: 0,
            len: page as u64,
        })
        .collect();

    // One pipeline (and so one wire) for both rounds: both ends count chunks
    // across transfers.
    let wire = RingPushWire::new(tx_e.clone(), peer_tx, desc, &credits, T).unwrap();
    let mut p = StagedPipeline::new(&tx_copy, wire, cfg).unwrap();
    // Rounds of different sizes (17, 3 and 10 chunks): slot use counts must stay
    // in step on both ends across transfers.
    for (round, n) in [40usize, 7, 23].into_iter().enumerate() {
        let (tx_segs, rx_segs) = (&tx_segs[..n], &rx_segs[..n]);
        // Fresh bytes each round, so a stale page cannot pass for a new one.
        let data = pattern(len, 9 + round as u8);
        tx_copy.upload(&src, 0, &data, T).unwrap();
        let sender = thread::scope(|s| {
            let h = s.spawn(|| p.write(src.span(), tx_segs, None));
            let mut done_at = None;
            let stats = rx
                .receive(peer_rx, credits_addr, dst.span(), rx_segs, || {
                    done_at = Some(Instant::now());
                    Ok(())
                })
                .unwrap_or_else(|e| panic!("{kind:?} round {round}: receive: {e}"));
            assert!(done_at.is_some(), "round {round}: completion ran");
            assert_eq!(stats.bytes, (n * page) as u64);
            h.join().unwrap()
        });
        sender.unwrap();
        let mut got = vec![0u8; len];
        rx.copy_engine().download(&dst, 0, &mut got, T).unwrap();
        for i in 0..n {
            let r = (i * 3 % pages) * page;
            assert!(
                got[r..r + page] == data[i * page..(i + 1) * page],
                "{kind:?} round {round}: page {i}"
            );
        }
    }
}

host_backend_tests!(push_rounds =>
    staged_push_into_remote_landing_ring_loopback,
    staged_push_into_remote_landing_ring_tcp
);

#[test]
fn receiver_copy_failure_means_no_completion_and_sender_times_out() {
    let (Some(tx_e), Some(rx_e)) = (engine(BackendKind::Loopback), engine(BackendKind::Loopback))
    else {
        return;
    };
    let cfg = StagingConfig {
        chunk_size: 4096,
        depth: 2,
        timeout: Duration::from_secs(2),
    };
    let len = 8 * 4096;
    let rx_copy = HostCopyEngine::new(HostFaults {
        fail_h2d_at: Some(3),
        ..Default::default()
    });
    let dst = rx_copy.alloc_device(len).unwrap();
    let mut rx = RingReceiver::new(rx_e.clone(), rx_copy, cfg).unwrap();
    let desc = rx.descriptor();
    let peer_tx = tx_e.connect(rx_e.local_addr()).unwrap();
    let peer_rx = rx_e.accept(Instant::now() + T).unwrap();
    let credits = CreditBoard::new(tx_e.clone(), cfg.depth).unwrap();
    let tx_copy = HostCopyEngine::default();
    let src = tx_copy.alloc_device(len).unwrap();
    let seg = whole(len as u64);
    let (rx_res, tx_res, completed) = thread::scope(|s| {
        let h = s.spawn(|| {
            let wire = RingPushWire::new(tx_e.clone(), peer_tx, desc, &credits, cfg.timeout)?;
            let mut p = StagedPipeline::new(&tx_copy, wire, cfg)?;
            p.write(src.span(), &seg, None)
        });
        let mut completed = false;
        let r = rx.receive(peer_rx, credits.addr(), dst.span(), &seg, || {
            completed = true;
            Ok(())
        });
        (r, h.join().unwrap(), completed)
    });
    assert!(
        matches!(
            rx_res,
            Err(GpuError::ChunkFailed {
                chunk: 3,
                stage: StageKind::Drain,
                ..
            })
        ),
        "{rx_res:?}"
    );
    assert!(!completed, "no completion after a failed copy");
    assert!(tx_res.is_err(), "the sender never gets credit 3");
}
