//! The staging pipeline on the CPU: host copy engine + in-memory wires.
//! Byte-exact results, chunk boundaries, back-pressure, and error paths.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use pagewire_gpudirect::testing::{Gate, MemWire, WireFaults, ring_link};
use pagewire_gpudirect::{
    CopyEngine, Direction, GpuError, HostCopyEngine, HostFaults, Segment, StageKind,
    StagedPipeline, StagedReceiver, StagingConfig, TraceEvent,
};
use proptest::prelude::*;

mod common;
use common::{pattern, whole};

const T: Duration = Duration::from_secs(10);

fn cfg(chunk_size: usize, depth: usize) -> StagingConfig {
    StagingConfig {
        chunk_size,
        depth,
        timeout: T,
    }
}

/// Page plan: `pages` pages of `page` bytes, local page i goes to remote page perm[i].
fn page_plan(page: u64, perm: &[usize]) -> Vec<Segment> {
    perm.iter()
        .enumerate()
        .map(|(i, &r)| Segment {
            local_off: i as u64 * page,
            remote_off: r as u64 * page,
            len: page,
        })
        .collect()
}

fn apply_reference(src: &[u8], dst: &mut [u8], segs: &[Segment], to_remote: bool) {
    for s in segs {
        let (l, r, n) = (s.local_off as usize, s.remote_off as usize, s.len as usize);
        if to_remote {
            dst[r..r + n].copy_from_slice(&src[l..l + n]);
        } else {
            dst[l..l + n].copy_from_slice(&src[r..r + n]);
        }
    }
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn staged_write_is_byte_exact(pages in 1usize..40, page in 1u64..700, chunk in 1usize..3000,
                                  depth in 1usize..6, seed in any::<u64>()) {
        let copy = HostCopyEngine::default();
        let len = pages * page as usize;
        let src = copy.alloc_device(len).unwrap();
        let data = pattern(len, seed as u8);
        copy.upload(&src, 0, &data, T).unwrap();
        let wire = MemWire::new(len);
        let remote = wire.remote();
        let segs = page_plan(page, &shuffled(pages, seed));
        let mut p = StagedPipeline::new(copy, wire, cfg(chunk, depth)).unwrap();
        let stats = p.write(src.span(), &segs, Some(9)).unwrap();
        let mut want = vec![0u8; len];
        apply_reference(&data, &mut want, &segs, true);
        prop_assert_eq!(remote.snapshot(), want);
        prop_assert_eq!(stats.bytes, len as u64);
        prop_assert_eq!(stats.chunks, len.div_ceil(chunk));
        prop_assert!(stats.max_in_flight <= depth);
        prop_assert_eq!(remote.notifications(), vec![9]);
    }

    #[test]
    fn staged_read_is_byte_exact(pages in 1usize..40, page in 1u64..700, chunk in 1usize..3000,
                                 depth in 1usize..6, seed in any::<u64>()) {
        let copy = HostCopyEngine::default();
        let len = pages * page as usize;
        let dst = copy.alloc_device(len).unwrap();
        let wire = MemWire::new(len);
        let remote = wire.remote();
        let data = pattern(len, seed as u8 ^ 0x5a);
        remote.fill(&data);
        let segs = page_plan(page, &shuffled(pages, seed));
        let mut p = StagedPipeline::new(copy, wire, cfg(chunk, depth)).unwrap();
        p.read(dst.span(), &segs).unwrap();
        let mut got = vec![0u8; len];
        p.copy_engine().download(&dst, 0, &mut got, T).unwrap();
        let mut want = vec![0u8; len];
        apply_reference(&data, &mut want, &segs, false);
        prop_assert_eq!(got, want);
        prop_assert!(remote.notifications().is_empty());
    }
}

#[test]
fn write_overlaps_copy_of_next_chunk_with_wire_of_current() {
    let copy = HostCopyEngine::new(HostFaults {
        delay: Duration::from_millis(2),
        ..Default::default()
    });
    let src = copy.alloc_device(8 * 1024).unwrap();
    let wire = MemWire::with_faults(
        8 * 1024,
        WireFaults {
            delay: Duration::from_millis(5),
            ..Default::default()
        },
    );
    let mut p = StagedPipeline::new(copy, wire, cfg(1024, 3)).unwrap();
    p.set_trace(true);
    let stats = p.write(src.span(), &whole(8 * 1024), Some(1)).unwrap();
    let pos = |e: TraceEvent| stats.trace.iter().position(|&x| x == e).unwrap();
    for i in 0..7 {
        // The next chunk's copy was issued before this chunk left the wire.
        assert!(
            pos(TraceEvent::FillStart(i + 1)) < pos(TraceEvent::DrainDone(i)),
            "{:?}",
            stats.trace
        );
    }
    // The notification comes after every drain.
    assert_eq!(stats.trace.last(), Some(&TraceEvent::Notified));
    assert!(
        stats
            .trace
            .iter()
            .filter(|e| matches!(e, TraceEvent::DrainDone(_)))
            .count()
            == 8
    );
    assert_eq!(stats.max_in_flight, 3);
}

#[test]
fn back_pressure_when_ring_is_full() {
    let copy = Arc::new(HostCopyEngine::default());
    let src = copy.alloc_device(10 * 512).unwrap();
    let data = pattern(10 * 512, 3);
    copy.upload(&src, 0, &data, T).unwrap();
    let gate = Gate::closed();
    let wire = MemWire::with_faults(
        10 * 512,
        WireFaults {
            gate: Some(gate.clone()),
            ..Default::default()
        },
    );
    let remote = wire.remote();
    let before = copy.copies_queued(Direction::D2H);
    let mut p = StagedPipeline::new(copy.clone(), wire, cfg(512, 3)).unwrap();
    let h = thread::spawn(move || {
        let seg = Segment {
            local_off: 0,
            remote_off: 0,
            len: 10 * 512,
        };
        let r = p.write(src.span(), &[seg], Some(4));
        drop(src);
        r
    });
    // With the wire held, exactly `depth` chunks get copied, then the pipeline waits.
    let t0 = Instant::now();
    while copy.copies_queued(Direction::D2H) - before < 3 && t0.elapsed() < T {
        thread::sleep(Duration::from_millis(1));
    }
    thread::sleep(Duration::from_millis(100));
    assert_eq!(copy.copies_queued(Direction::D2H) - before, 3);
    assert_eq!(remote.writes(), 0);
    assert!(remote.notifications().is_empty());
    gate.open();
    let stats = h.join().unwrap().unwrap();
    assert_eq!(copy.copies_queued(Direction::D2H) - before, 10);
    assert!(stats.ring_full_waits >= 1);
    assert_eq!(stats.max_in_flight, 3);
    assert_eq!(remote.snapshot(), data);
    assert_eq!(remote.notifications(), vec![4]);
}

#[test]
fn wire_error_mid_pipeline_fails_batch_without_notification() {
    let copy = HostCopyEngine::default();
    let src = copy.alloc_device(16 * 256).unwrap();
    let wire = MemWire::with_faults(
        16 * 256,
        WireFaults {
            fail_write_at: Some(5),
            ..Default::default()
        },
    );
    let remote = wire.remote();
    let mut p = StagedPipeline::new(copy, wire, cfg(256, 4)).unwrap();
    let seg = Segment {
        local_off: 0,
        remote_off: 0,
        len: 16 * 256,
    };
    let err = p.write(src.span(), &[seg], Some(1)).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::ChunkFailed {
                chunk: 5,
                stage: StageKind::Drain,
                ..
            }
        ),
        "{err}"
    );
    assert!(remote.notifications().is_empty());
    // The ring was quiesced, so the pipeline is usable again.
    p.write(src.span(), &[seg], Some(2)).unwrap();
    assert_eq!(remote.notifications(), vec![2]);
}

#[test]
fn copy_error_mid_pipeline_fails_batch_without_notification() {
    let copy = HostCopyEngine::new(HostFaults {
        fail_d2h_at: Some(3),
        ..Default::default()
    });
    let src = copy.alloc_device(8 * 100).unwrap();
    let wire = MemWire::new(8 * 100);
    let remote = wire.remote();
    let mut p = StagedPipeline::new(copy, wire, cfg(100, 2)).unwrap();
    let err = p.write(src.span(), &whole(800), Some(1)).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::ChunkFailed {
                chunk: 3,
                stage: StageKind::Fill,
                ..
            }
        ),
        "{err}"
    );
    assert!(remote.notifications().is_empty());
    // Chunks after the failed one never reached the wire.
    assert!(remote.writes() <= 3, "{}", remote.writes());
}

#[test]
fn read_errors_surface_per_stage() {
    let copy = HostCopyEngine::new(HostFaults {
        fail_h2d_at: Some(2),
        ..Default::default()
    });
    let dst = copy.alloc_device(1000).unwrap();
    let mut p = StagedPipeline::new(copy, MemWire::new(1000), cfg(100, 3)).unwrap();
    let seg = Segment {
        local_off: 0,
        remote_off: 0,
        len: 1000,
    };
    let err = p.read(dst.span(), &[seg]).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::ChunkFailed {
                chunk: 2,
                stage: StageKind::Drain,
                ..
            }
        ),
        "{err}"
    );

    let copy = HostCopyEngine::default();
    let dst = copy.alloc_device(1000).unwrap();
    let wire = MemWire::with_faults(
        1000,
        WireFaults {
            fail_read_at: Some(0),
            ..Default::default()
        },
    );
    let mut p = StagedPipeline::new(copy, wire, cfg(100, 3)).unwrap();
    let err = p.read(dst.span(), &[seg]).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::ChunkFailed {
                chunk: 0,
                stage: StageKind::Fill,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn out_of_range_plans_are_refused_before_any_io() {
    let copy = HostCopyEngine::default();
    let src = copy.alloc_device(100).unwrap();
    let wire = MemWire::new(1000);
    let remote = wire.remote();
    let mut p = StagedPipeline::new(copy, wire, cfg(64, 2)).unwrap();
    let bad = Segment {
        local_off: 50,
        remote_off: 0,
        len: 51,
    };
    assert!(matches!(
        p.write(src.span(), &[bad], Some(1)),
        Err(GpuError::OutOfRange { .. })
    ));
    let overflow = Segment {
        local_off: 0,
        remote_off: u64::MAX - 1,
        len: 10,
    };
    assert!(matches!(
        p.write(src.span(), &[overflow], Some(1)),
        Err(GpuError::OutOfRange { .. })
    ));
    // Remote range past the peer's region: the wire refuses, the batch fails.
    let far = Segment {
        local_off: 0,
        remote_off: 995,
        len: 10,
    };
    assert!(matches!(
        p.write(src.span(), &[far], Some(1)),
        Err(GpuError::ChunkFailed { .. })
    ));
    assert_eq!(remote.writes(), 0);
    assert!(remote.notifications().is_empty());
}

#[test]
fn stuck_wire_times_out_and_retires_the_ring() {
    let copy = HostCopyEngine::default();
    let src = copy.alloc_device(1024).unwrap();
    let gate = Gate::closed();
    let wire = MemWire::with_faults(
        1024,
        WireFaults {
            gate: Some(gate.clone()),
            ..Default::default()
        },
    );
    let remote = wire.remote();
    let c = StagingConfig {
        chunk_size: 256,
        depth: 2,
        timeout: Duration::from_millis(200),
    };
    let mut p = StagedPipeline::new(copy, wire, c).unwrap();
    let seg = Segment {
        local_off: 0,
        remote_off: 0,
        len: 1024,
    };
    let t0 = Instant::now();
    let err = p.write(src.span(), &[seg], Some(1)).unwrap_err();
    assert!(matches!(err, GpuError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // DMA may still be pending on the ring, so the pipeline refuses to reuse it.
    assert!(matches!(
        p.write(src.span(), &[seg], Some(1)),
        Err(GpuError::RingRetired)
    ));
    gate.open();
    assert!(remote.notifications().is_empty());
}

#[test]
fn receiver_copies_to_gpu_and_notifies_after_last_h2d() {
    let c = cfg(300, 3);
    let len = 5000;
    let tx_copy = HostCopyEngine::new(HostFaults {
        delay: Duration::from_micros(200),
        ..Default::default()
    });
    let src = tx_copy.alloc_device(len).unwrap();
    let data = pattern(len, 77);
    tx_copy.upload(&src, 0, &data, T).unwrap();
    let rx_copy = HostCopyEngine::new(HostFaults {
        delay: Duration::from_micros(300),
        ..Default::default()
    });
    let dst = rx_copy.alloc_device(len).unwrap();

    let (wire, mut incoming) = ring_link();
    let mut rx = StagedReceiver::new(rx_copy, c).unwrap();
    rx.set_trace(true);
    // SAFETY: the receiver (and so its ring) outlives the link's use below.
    unsafe { incoming.publish_ring(rx.ring().unwrap()) };
    // Two 2500-byte halves, swapped on the receiving side.
    let tx_segs = [
        Segment {
            local_off: 0,
            remote_off: 2500,
            len: 2500,
        },
        Segment {
            local_off: 2500,
            remote_off: 0,
            len: 2500,
        },
    ];
    let rx_segs = [
        Segment {
            local_off: 2500,
            remote_off: 0,
            len: 2500,
        },
        Segment {
            local_off: 0,
            remote_off: 0,
            len: 2500,
        },
    ];
    let sender = thread::spawn(move || {
        let mut p = StagedPipeline::new(tx_copy, wire, c).unwrap();
        let r = p.write(src.span(), &tx_segs, None);
        drop(src);
        r
    });
    let mut completed_at = None;
    let stats = rx
        .receive(dst.span(), &rx_segs, &mut incoming, || {
            completed_at = Some(Instant::now());
            Ok(())
        })
        .unwrap();
    sender.join().unwrap().unwrap();
    assert!(completed_at.is_some());
    let last_drain = stats
        .trace
        .iter()
        .rposition(|e| matches!(e, TraceEvent::DrainDone(_)))
        .unwrap();
    let notified = stats
        .trace
        .iter()
        .position(|e| *e == TraceEvent::Notified)
        .unwrap();
    assert!(notified > last_drain);
    assert_eq!(stats.chunks, len.div_ceil(300));
    let mut got = vec![0u8; len];
    rx.copy_engine().download(&dst, 0, &mut got, T).unwrap();
    let mut want = vec![0u8; len];
    want[2500..].copy_from_slice(&data[..2500]);
    want[..2500].copy_from_slice(&data[2500..]);
    assert_eq!(got, want);
}

#[test]
fn receiver_h2d_failure_means_no_completion() {
    let c = cfg(256, 2);
    let tx_copy = HostCopyEngine::default();
    let src = tx_copy.alloc_device(2048).unwrap();
    let rx_copy = HostCopyEngine::new(HostFaults {
        fail_h2d_at: Some(4),
        ..Default::default()
    });
    let dst = rx_copy.alloc_device(2048).unwrap();
    let (wire, mut incoming) = ring_link();
    let mut rx = StagedReceiver::new(rx_copy, c).unwrap();
    // SAFETY: the receiver outlives the link's use.
    unsafe { incoming.publish_ring(rx.ring().unwrap()) };
    let seg = whole(2048);
    let sender = thread::spawn(move || {
        let c = StagingConfig {
            timeout: Duration::from_secs(2),
            ..c
        };
        let mut p = StagedPipeline::new(tx_copy, wire, c).unwrap();
        let r = p.write(src.span(), &seg, None);
        drop(src);
        r
    });
    let mut completed = false;
    let err = rx.receive(dst.span(), &seg, &mut incoming, || {
        completed = true;
        Ok(())
    });
    assert!(
        matches!(
            err,
            Err(GpuError::ChunkFailed {
                chunk: 4,
                stage: StageKind::Drain,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(!completed);
    // The sender never gets the credit for chunk 4: it times out instead of hanging.
    assert!(sender.join().unwrap().is_err());
}
