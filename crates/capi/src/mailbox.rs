//! Named notifications (`notify_msg {name, msg}`) over one-sided operations.
//!
//! The transport notifies with a 32-bit tag that arrives only after every byte of its
//! batch is in the peer's memory. Mooncake's notifications carry two strings, so each
//! engine keeps an *outbox* of fixed slots, registered for remote READ only:
//!
//! 1. The sender writes `name` and `msg` into a free slot, then submits its batch with
//!    the tag `MSG | slot | generation`.
//! 2. The receiver's mailbox thread sees the tag (after the data), READs that slot from
//!    the sender's outbox into its own inbox, queues `(name, msg)` for
//!    `getNotifsFromEngine`, and answers with a notify-only batch tagged `ACK | slot |
//!    generation`, which frees the slot on the sender.
//!
//! The outbox is recognised among a peer's exposed regions as the run of READ-only memory
//! of exactly [`OUTBOX_BYTES`]: memory registered through the C ABI is exposed for both
//! READ and WRITE or not at all. A generation in the tag and in the slot header catches a
//! slot that was reclaimed and reused before the receiver read it. Flow control is the
//! slot count: a receiver whose application does not drain its queue stops reading, so
//! its senders run out of slots and get `kTooManyRequests`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};
use pagewire_transport::{
    Access, Batch, BatchStatus, Engine, Notification, PeerId, RegionId, RemoteRegion,
    TransferHandle,
};

use crate::codes::Code;
use crate::rawmem::RawBuf;

/// Slots in one engine's outbox (a sender's notifications in flight, all peers together).
pub(crate) const SLOTS: usize = 256;
/// Bytes per slot.
pub(crate) const SLOT_BYTES: usize = 8192;
/// The outbox's size, which is how peers recognise it.
pub(crate) const OUTBOX_BYTES: usize = SLOTS * SLOT_BYTES;
const HEADER: usize = 16;
/// Largest `strlen(name) + strlen(msg)` of one notification.
pub(crate) const MAX_NOTIFY_BYTES: usize = SLOT_BYTES - HEADER;
const MAGIC: u32 = u32::from_le_bytes(*b"PWNM");

const KIND_MASK: u32 = 0b11 << 30;
const KIND_MSG: u32 = 0b10 << 30;
const KIND_ACK: u32 = 0b11 << 30;
const GEN_BITS: u32 = 22;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

/// How long a READ of a peer's slot, or an ACK, may take.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A slot held longer than this is reclaimed (its receiver never answered).
const SLOT_LEASE: Duration = Duration::from_secs(120);
/// Received notifications queued for the application, at most.
const QUEUE_MAX: usize = 4096;

fn tag(kind: u32, slot: usize, generation: u32) -> u32 {
    kind | ((slot as u32) << GEN_BITS) | (generation & GEN_MASK)
}

fn untag(tag: u32) -> (u32, usize, u32) {
    (
        tag & KIND_MASK,
        ((tag & !KIND_MASK) >> GEN_BITS) as usize,
        tag & GEN_MASK,
    )
}

/// A slot that holds an outgoing notification.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Staged {
    slot: usize,
    generation: u32,
}

impl Staged {
    /// The tag the carrying batch must use.
    pub(crate) fn tag(&self) -> u32 {
        tag(KIND_MSG, self.slot, self.generation)
    }
}

#[derive(Debug)]
struct Held {
    peer: PeerId,
    generation: u32,
    since: Instant,
    carrier: Option<TransferHandle>,
}

#[derive(Debug, Default)]
struct Slots {
    next_generation: u32,
    held: Vec<Option<Held>>,
}

/// One engine's mailbox: its outbox and inbox memory, the slot table and the queue of
/// received notifications.
#[derive(Debug)]
pub(crate) struct Mailbox {
    engine: Engine,
    outbox: RawBuf,
    inbox: RawBuf,
    regions: Mutex<Option<(RegionId, RegionId)>>,
    slots: Mutex<Slots>,
    freed: Condvar,
    queue: Mutex<VecDeque<(Vec<u8>, Vec<u8>)>>,
    /// Pokes the mailbox thread when the application drained the queue.
    wake: Sender<()>,
    wake_rx: Receiver<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Mailbox {
    /// Allocates and registers the outbox (remote READ only) and the inbox (local).
    pub(crate) fn new(engine: &Engine) -> Result<Arc<Mailbox>, pagewire_transport::Error> {
        let alloc = |n| {
            RawBuf::new(n).ok_or(pagewire_transport::Error::Registration {
                addr: 0,
                len: n as u64,
                reason: "mailbox allocation failed".into(),
            })
        };
        let outbox = alloc(OUTBOX_BYTES)?;
        let inbox = alloc(SLOT_BYTES)?;
        // SAFETY: both buffers are live allocations owned by the mailbox, which
        // deregisters them (`close`) before they are freed, and leaks them if that fails.
        let out_id =
            unsafe { engine.register_raw(outbox.as_mut_ptr(), outbox.len(), Access::REMOTE_READ)? };
        // SAFETY: as above.
        let in_id = match unsafe {
            engine.register_raw(inbox.as_mut_ptr(), inbox.len(), Access::LOCAL_WRITE)
        } {
            Ok(id) => id,
            Err(e) => {
                if engine.deregister(out_id).is_err() {
                    std::mem::forget(outbox);
                }
                return Err(e);
            }
        };
        let (wake, wake_rx) = crossbeam_channel::bounded(1);
        Ok(Arc::new(Mailbox {
            engine: engine.clone(),
            outbox,
            inbox,
            regions: Mutex::new(Some((out_id, in_id))),
            slots: Mutex::new(Slots {
                next_generation: 1,
                held: (0..SLOTS).map(|_| None).collect(),
            }),
            freed: Condvar::new(),
            queue: Mutex::new(VecDeque::new()),
            wake,
            wake_rx,
        }))
    }

    /// Deregisters the mailbox memory. Returns whether it is safe to free it.
    pub(crate) fn close(&self, deadline: Instant) -> bool {
        let Some((out_id, in_id)) = lock(&self.regions).take() else {
            return true;
        };
        let a = self.engine.deregister_wait(out_id, deadline).is_ok();
        let b = self.engine.deregister_wait(in_id, deadline).is_ok();
        a && b
    }

    // ------------------------------------------------------------------ sending

    /// Writes a notification into a free slot for `peer`, waiting until `until` for one.
    pub(crate) fn stage(
        &self,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        until: Instant,
    ) -> Result<Staged, Code> {
        if name.len() + msg.len() > MAX_NOTIFY_BYTES {
            crate::set_last_error(format_args!(
                "notification of {} bytes (name + msg) exceeds {MAX_NOTIFY_BYTES}",
                name.len() + msg.len()
            ));
            return Err(Code::InvalidArgument);
        }
        let mut s = lock(&self.slots);
        let slot = loop {
            if let Some(i) = s.held.iter().position(Option::is_none) {
                break i;
            }
            reclaim(&mut s.held, &self.engine, Instant::now());
            if let Some(i) = s.held.iter().position(Option::is_none) {
                break i;
            }
            let now = Instant::now();
            if now >= until {
                crate::set_last_error(format_args!(
                    "all {SLOTS} notification slots are in flight (receivers not draining)"
                ));
                return Err(Code::TooManyRequests);
            }
            s = self
                .freed
                .wait_timeout(s, (until - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        let generation = s.next_generation & GEN_MASK;
        s.next_generation = s.next_generation.wrapping_add(1);
        let mut bytes = Vec::with_capacity(HEADER + name.len() + msg.len());
        bytes.extend_from_slice(&MAGIC.to_le_bytes());
        bytes.extend_from_slice(&generation.to_le_bytes());
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(msg);
        self.outbox.write(slot * SLOT_BYTES, &bytes);
        s.held[slot] = Some(Held {
            peer,
            generation,
            since: Instant::now(),
            carrier: None,
        });
        Ok(Staged { slot, generation })
    }

    /// Records the batch that carries a staged notification (a failed batch frees it).
    pub(crate) fn attach(&self, staged: Staged, carrier: TransferHandle) {
        let mut s = lock(&self.slots);
        if let Some(h) = s.held[staged.slot].as_mut()
            && h.generation == staged.generation
        {
            h.carrier = Some(carrier);
        }
    }

    /// Frees a staged slot whose batch was never submitted.
    pub(crate) fn release(&self, staged: Staged) {
        self.free(None, staged.slot, staged.generation);
    }

    fn free(&self, peer: Option<PeerId>, slot: usize, generation: u32) {
        let mut s = lock(&self.slots);
        if let Some(held) = s.held.get(slot).and_then(Option::as_ref)
            && held.generation == generation
            && peer.is_none_or(|p| p == held.peer)
        {
            s.held[slot] = None;
            // Peers can read the outbox: do not leave the text there longer than needed.
            self.outbox.write(slot * SLOT_BYTES, &[0u8; SLOT_BYTES]);
            self.freed.notify_all();
        }
    }

    /// Sends a notification alone and waits for its delivery (until `deadline`).
    pub(crate) fn send(
        &self,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        deadline: Instant,
    ) -> Result<(), Code> {
        let staged = self.stage(peer, name, msg, deadline)?;
        let batch = Batch::new().notify(staged.tag()).deadline(deadline);
        match self.engine.submit(peer, batch) {
            Ok(h) => {
                self.attach(staged, h.clone());
                h.wait(deadline).map(drop).map_err(|e| Code::from_err(&e))
            }
            Err(e) => {
                self.release(staged);
                Err(Code::from_err(&e))
            }
        }
    }

    // ------------------------------------------------------------------ receiving

    /// Takes every queued notification.
    pub(crate) fn drain(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let out: Vec<_> = lock(&self.queue).drain(..).collect();
        let _ = self.wake.try_send(());
        out
    }

    /// The mailbox thread: reads notified slots, queues them, answers, and reclaims
    /// slots whose receiver is gone. Returns when `stop` fires or the engine goes.
    pub(crate) fn run(self: Arc<Self>, stop: Receiver<()>) {
        let notes = self.engine.notifications();
        let mut pending: VecDeque<Notification> = VecDeque::new();
        let mut outboxes: HashMap<PeerId, u64> = HashMap::new();
        // Peers whose outbox was not found, and when: not asked again within a second,
        // so a peer without one cannot keep this thread busy re-describing it.
        let mut missing: HashMap<PeerId, Instant> = HashMap::new();
        let mut last_sweep = Instant::now();
        loop {
            while lock(&self.queue).len() < QUEUE_MAX {
                let Some(n) = pending.pop_front() else { break };
                if stop.try_recv().is_ok() {
                    return;
                }
                self.receive(n, &mut outboxes, &mut missing);
            }
            select! {
                recv(stop) -> _ => return,
                recv(notes) -> n => match n {
                    Ok(n) => match untag(n.tag) {
                        (KIND_ACK, slot, generation) => self.free(Some(n.peer), slot, generation),
                        (KIND_MSG, ..) => pending.push_back(n),
                        // Not ours: the C ABI's peers only send MSG and ACK tags.
                        _ => tracing::debug!(tag = n.tag, peer = %n.peer, "foreign tag ignored"),
                    },
                    Err(_) => return,
                },
                recv(self.wake_rx) -> _ => {}
                default(Duration::from_millis(500)) => {}
            }
            if last_sweep.elapsed() >= Duration::from_millis(500) {
                last_sweep = Instant::now();
                let mut s = lock(&self.slots);
                if reclaim(&mut s.held, &self.engine, last_sweep) {
                    self.freed.notify_all();
                }
                drop(s);
                outboxes.retain(|p, _| self.engine.peer_alive(*p).unwrap_or(false));
                missing.retain(|_, t| t.elapsed() < Duration::from_secs(1));
            }
        }
    }

    fn receive(
        &self,
        n: Notification,
        outboxes: &mut HashMap<PeerId, u64>,
        missing: &mut HashMap<PeerId, Instant>,
    ) {
        let (_, slot, generation) = untag(n.tag);
        let base = match outboxes.get(&n.peer) {
            Some(&b) => b,
            None if missing
                .get(&n.peer)
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1)) =>
            {
                return;
            }
            None => match self.outbox_of(n.peer) {
                Some(b) => {
                    outboxes.insert(n.peer, b);
                    b
                }
                None => {
                    tracing::warn!(peer = %n.peer, "notification from a peer without an outbox dropped");
                    missing.insert(n.peer, Instant::now());
                    return;
                }
            },
        };
        let deadline = Instant::now() + IO_TIMEOUT;
        let read = Batch::new()
            .read(
                self.inbox.addr(),
                base + (slot * SLOT_BYTES) as u64,
                SLOT_BYTES as u64,
            )
            .deadline(deadline);
        let got = self
            .engine
            .submit(n.peer, read)
            .and_then(|h| h.wait(deadline));
        if let Err(e) = got {
            tracing::warn!(peer = %n.peer, error = %e, "reading a notification failed");
            return;
        }
        match parse(&self.inbox.read(0, SLOT_BYTES), generation) {
            Some(m) => lock(&self.queue).push_back(m),
            None => tracing::warn!(peer = %n.peer, slot, "malformed or stale notification dropped"),
        }
        // The slot can be reused now; the ACK is not waited for.
        let ack = Batch::new()
            .notify(tag(KIND_ACK, slot, generation))
            .timeout(IO_TIMEOUT);
        if let Err(e) = self.engine.submit(n.peer, ack) {
            tracing::warn!(peer = %n.peer, error = %e, "acknowledging a notification failed");
        }
    }
}

impl Mailbox {
    /// Where a peer's outbox is. The transport publishes a peer on both sides before
    /// `connect` returns, so a notification never names a peer this engine does not know.
    fn outbox_of(&self, peer: PeerId) -> Option<u64> {
        let regions = self.engine.peer_regions(peer).ok()?;
        find_outbox(&regions).or_else(|| {
            // Registered after the handshake (not by this library, which registers the
            // outbox first): ask the peer again.
            self.engine
                .redescribe(peer)
                .ok()
                .and_then(|r| find_outbox(&r))
        })
    }
}

/// Frees slots whose carrying batch failed, whose receiver is gone, or that outlived the
/// lease. Returns whether any was freed.
fn reclaim(held: &mut [Option<Held>], engine: &Engine, now: Instant) -> bool {
    let mut any = false;
    for h in held.iter_mut() {
        let drop_it = h.as_ref().is_some_and(|h| {
            matches!(
                h.carrier.as_ref().map(TransferHandle::status),
                Some(BatchStatus::Failed(_) | BatchStatus::Cancelled)
            ) || !engine.peer_alive(h.peer).unwrap_or(false)
                || now.duration_since(h.since) > SLOT_LEASE
        });
        if drop_it {
            *h = None;
            any = true;
        }
    }
    any
}

/// The start of a peer's outbox: a run of adjacent READ-only regions of `OUTBOX_BYTES`.
pub(crate) fn find_outbox(regions: &[RemoteRegion]) -> Option<u64> {
    let mut sorted: Vec<_> = regions.iter().collect();
    sorted.sort_by_key(|r| r.addr);
    let mut run: Option<(u64, u64)> = None;
    for r in sorted {
        if r.access != Access::REMOTE_READ {
            run = None;
            continue;
        }
        run = match run {
            Some((start, end)) if end == r.addr => Some((start, r.end())),
            _ => Some((r.addr, r.end())),
        };
        if let Some((start, end)) = run
            && end - start == OUTBOX_BYTES as u64
        {
            return Some(start);
        }
    }
    None
}

/// Decodes a slot read from a peer; `None` if it is not a notification of `generation`.
fn parse(bytes: &[u8], generation: u32) -> Option<(Vec<u8>, Vec<u8>)> {
    let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    if bytes.len() < HEADER || word(0) != MAGIC || word(4) != generation {
        return None;
    }
    let (n, m) = (word(8) as usize, word(12) as usize);
    if n.checked_add(m)? > bytes.len() - HEADER {
        return None;
    }
    let name = bytes[HEADER..HEADER + n].to_vec();
    let msg = bytes[HEADER + n..HEADER + n + m].to_vec();
    Some((name, msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        for (slot, generation) in [(0, 0), (255, GEN_MASK), (17, 12345)] {
            assert_eq!(
                untag(tag(KIND_MSG, slot, generation)),
                (KIND_MSG, slot, generation)
            );
            assert_eq!(untag(tag(KIND_ACK, slot, generation)).0, KIND_ACK);
        }
        assert_eq!(untag(7).0, 0, "plain small tags are neither kind");
    }

    #[test]
    fn parse_refuses_hostile_slots() {
        let mut s = vec![0u8; SLOT_BYTES];
        s[..4].copy_from_slice(&MAGIC.to_le_bytes());
        s[4..8].copy_from_slice(&9u32.to_le_bytes());
        s[8..12].copy_from_slice(&2u32.to_le_bytes());
        s[12..16].copy_from_slice(&3u32.to_le_bytes());
        s[16..21].copy_from_slice(b"abxyz");
        assert_eq!(parse(&s, 9), Some((b"ab".to_vec(), b"xyz".to_vec())));
        assert_eq!(parse(&s, 8), None, "stale generation");
        s[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse(&s, 9), None, "length beyond the slot");
        s[..4].copy_from_slice(b"HTTP");
        assert_eq!(parse(&s, 9), None, "bad magic");
    }

    #[test]
    fn outbox_is_the_read_only_run_of_the_right_size() {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let half = (OUTBOX_BYTES / 2) as u64;
        let regions = [
            RemoteRegion::new(0x10_0000, OUTBOX_BYTES as u64, 1, rw),
            RemoteRegion::new(0x100_0000 + half, half, 3, Access::REMOTE_READ),
            RemoteRegion::new(0x100_0000, half, 2, Access::REMOTE_READ),
        ];
        assert_eq!(find_outbox(&regions), Some(0x100_0000));
        assert_eq!(find_outbox(&regions[..2]), None);
    }
}
