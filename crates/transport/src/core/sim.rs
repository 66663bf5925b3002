//! A deterministic two-engine simulation over the core alone: no sockets, no threads, a
//! simulated clock and simulated memory (byte vectors at simulated addresses, so no
//! pointer and no `unsafe`). It drives the same pieces the backends use — validation
//! (`resolve`), slicing (`slice::pieces`), the batch state with its deadline, the notify
//! gate — through a network of messages with a fixed latency, and checks the transport's
//! promises step by step: bytes exact on the receiving side, the tag surfaced only after
//! every byte landed, a deadline that fails the batch at simulated time, a cancelled batch
//! that surfaces no tag.
#![cfg(test)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::core::batch::{BatchState, BatchStatus, NotifyGate};
use crate::core::registry::{Chunk, Registry, RemoteTable};
use crate::core::resolve::{ResolvedOp, resolve};
use crate::core::slice::pieces;
use crate::types::{Access, Op, PeerId, TransferOp};

/// Simulated memory: `len` bytes at simulated address `base`.
struct Memory {
    base: u64,
    bytes: Vec<u8>,
}

impl Memory {
    fn range(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let at = (addr - self.base) as usize;
        &mut self.bytes[at..at + len as usize]
    }
}

struct Side {
    registry: Registry,
    mem: Memory,
}

impl Side {
    /// One region of `len` bytes at `base`, registered as chunks of `chunk` bytes with keys
    /// 1, 2, ... (so ops are split at chunk edges, as with real MRs).
    fn new(base: u64, len: u64, chunk: u64, access: Access) -> Self {
        let registry = Registry::default();
        let chunks = pieces(len, chunk)
            .enumerate()
            .map(|(i, (off, n))| Chunk {
                addr: base + off,
                len: n,
                lkey: i as u32 + 1,
                rkey: i as u32 + 1,
                lrails: crate::types::RailKeys::NONE,
                rrails: crate::types::RailKeys::NONE,
            })
            .collect();
        registry
            .finish_insert(base, len, access, chunks, Vec::new(), None)
            .unwrap();
        Side {
            registry,
            mem: Memory {
                base,
                bytes: vec![0; len as usize],
            },
        }
    }
}

enum Msg {
    /// A data piece of a WRITE, carried to the responder.
    Data { remote: u64, bytes: Vec<u8> },
    /// The responder's acknowledgement of one piece.
    Ack,
    /// The notification, sent once the gate opened.
    Notify(u32),
    /// Its acknowledgement: the batch is done.
    NotifyAck,
}

/// Two engines, A (requester) and B (responder), one batch at a time.
struct SimPair {
    now: Instant,
    latency: Duration,
    a: Side,
    b: Side,
    /// Messages in flight, with their arrival time (FIFO: one latency for all).
    wire: VecDeque<(Instant, Msg)>,
    /// Tags B's application has received.
    notes: Vec<u32>,
    batch: Option<(BatchState, NotifyGate, Option<u32>)>,
}

const MAX_PIECE: u64 = 1000;

impl SimPair {
    fn new(latency: Duration) -> Self {
        SimPair {
            // The only clock read: the epoch of simulated time.
            now: Instant::now(),
            latency,
            a: Side::new(0x1_0000, 8192, 4096, Access::LOCAL_WRITE),
            b: Side::new(0x9_0000, 8192, 3000, Access::REMOTE_WRITE),
            wire: VecDeque::new(),
            notes: Vec::new(),
            batch: None,
        }
    }

    /// Submits WRITEs with an optional tag and a timeout, as the engine does: validate and
    /// resolve, arm the gate with the piece count, put every piece on the wire.
    fn submit(&mut self, ops: &[TransferOp], tag: Option<u32>, timeout: Duration) {
        let table = RemoteTable::new(self.b.registry.exposed());
        let (pins, resolved, bytes) = resolve(&self.a.registry, &table, PeerId(1), ops).unwrap();
        let count: u64 = resolved
            .iter()
            .map(|o| pieces(o.len, MAX_PIECE).count() as u64)
            .sum();
        let state = BatchState::new(
            1,
            PeerId(1),
            ops.len(),
            resolved.len(),
            bytes,
            self.now,
            self.now + timeout,
            pins,
            None,
        );
        let at = self.now + self.latency;
        for o in &resolved {
            let ResolvedOp {
                local, remote, len, ..
            } = *o;
            for (off, n) in pieces(len, MAX_PIECE) {
                let bytes = self.a.mem.range(local + off, n).to_vec();
                self.wire.push_back((
                    at,
                    Msg::Data {
                        remote: remote + off,
                        bytes,
                    },
                ));
            }
        }
        if count == 0
            && let Some(t) = tag
        {
            self.wire.push_back((at, Msg::Notify(t)));
        }
        self.batch = Some((state, NotifyGate::new(count), tag));
    }

    /// Advances simulated time by `dt`, delivering what arrives meanwhile in order.
    fn step(&mut self, dt: Duration) {
        self.now += dt;
        while self.wire.front().is_some_and(|(t, _)| *t <= self.now) {
            let (t, msg) = self.wire.pop_front().expect("checked");
            let back = t + self.latency;
            match msg {
                Msg::Data { remote, bytes } => {
                    self.b
                        .mem
                        .range(remote, bytes.len() as u64)
                        .copy_from_slice(&bytes);
                    self.wire.push_back((back, Msg::Ack));
                }
                Msg::Ack => {
                    let (state, gate, tag) = self.batch.as_ref().expect("a batch");
                    state.add_progress(1, 0);
                    if gate.landed(1) && !state.should_stop(t) {
                        match tag {
                            Some(tag) => self.wire.push_back((back, Msg::Notify(*tag))),
                            None => state.succeed(t),
                        }
                    }
                }
                Msg::Notify(tag) => {
                    self.notes.push(tag);
                    self.wire.push_back((back, Msg::NotifyAck));
                }
                Msg::NotifyAck => self.batch.as_ref().expect("a batch").0.succeed(t),
            }
        }
        if let Some((state, ..)) = &self.batch {
            state.expire_if_due(self.now);
        }
    }

    fn status(&self) -> BatchStatus {
        self.batch
            .as_ref()
            .expect("a batch")
            .0
            .shared()
            .status(self.now)
    }
}

fn write(local: u64, remote: u64, len: u64) -> TransferOp {
    TransferOp {
        op: Op::Write,
        local,
        remote,
        len,
    }
}

#[test]
fn the_tag_comes_after_every_byte_and_the_bytes_are_exact() {
    let mut p = SimPair::new(Duration::from_micros(10));
    for (i, b) in p.a.mem.bytes.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    // Crosses A's chunk edge at 0x1_1000 and B's at 0x9_0000 + 3000; 5 KiB in 1000-byte pieces.
    p.submit(
        &[write(0x1_0800, 0x9_0400, 5120)],
        Some(42),
        Duration::from_secs(1),
    );
    let want = p.a.mem.bytes[0x800..0x800 + 5120].to_vec();
    for _ in 0..100 {
        p.step(Duration::from_micros(1));
        if !p.notes.is_empty() {
            // Surfaced: every byte must be in place at this moment.
            assert_eq!(&p.b.mem.bytes[0x400..0x400 + 5120], &want[..]);
        }
    }
    assert_eq!(p.notes, [42]);
    assert!(matches!(p.status(), BatchStatus::Done));
    // Guard bytes around the target are untouched.
    assert_eq!(p.b.mem.bytes[0x3ff], 0);
    assert_eq!(p.b.mem.bytes[0x400 + 5120], 0);
}

#[test]
fn a_deadline_fails_the_batch_in_simulated_time() {
    // Each way takes 2 s; the batch allows 1 s.
    let mut p = SimPair::new(Duration::from_secs(2));
    p.submit(
        &[write(0x1_0000, 0x9_0000, 10)],
        Some(7),
        Duration::from_secs(1),
    );
    p.step(Duration::from_millis(999));
    assert!(matches!(p.status(), BatchStatus::Pending));
    p.step(Duration::from_millis(1));
    assert!(matches!(
        p.status(),
        BatchStatus::Failed(crate::error::Error::Timeout { .. })
    ));
    // The late acknowledgement does not surface the tag of a failed batch.
    p.step(Duration::from_secs(10));
    assert!(p.notes.is_empty(), "{:?}", p.notes);
}

#[test]
fn a_cancelled_batch_surfaces_no_tag() {
    let mut p = SimPair::new(Duration::from_micros(10));
    p.submit(
        &[write(0x1_0000, 0x9_0000, 4000)],
        Some(9),
        Duration::from_secs(1),
    );
    p.step(Duration::from_micros(10)); // the data lands; acks are on their way
    let (state, ..) = p.batch.as_ref().unwrap();
    assert!(state.shared().cancel());
    p.step(Duration::from_millis(1));
    assert!(p.notes.is_empty());
    assert!(matches!(p.status(), BatchStatus::Cancelled));
}

#[test]
fn a_notification_alone_needs_no_data() {
    let mut p = SimPair::new(Duration::from_micros(10));
    p.submit(&[], Some(5), Duration::from_secs(1));
    p.step(Duration::from_micros(30));
    assert_eq!(p.notes, [5]);
    assert!(matches!(p.status(), BatchStatus::Done));
}
