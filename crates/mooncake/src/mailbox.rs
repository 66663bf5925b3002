//! Named notifications (Mooncake's `{name, msg}`) over pagewire's 32-bit batch tags.
//!
//! The transport surfaces a batch's tag on the receiving engine only once every byte of
//! the batch is in its memory. Mooncake's notifications carry two strings, so the
//! strings travel through memory the receiver reads, and the tag says where:
//!
//! 1. Each engine registers an *outbox* of [`SLOTS`] x [`SLOT_BYTES`] that peers may
//!    READ but not write (memory registered through this crate is exposed for READ and
//!    WRITE or not at all, so the outbox is the one read-only run of [`OUTBOX_BYTES`]:
//!    that is how a receiver finds it among the sender's regions), and a private inbox.
//! 2. The sender writes `header + name + msg` into a free slot (header: magic,
//!    generation, name length, msg length, little-endian `u32`s) and submits its batch
//!    with the tag `MSG | slot | generation`.
//! 3. The receiver's worker thread, on that tag (so after the data), READs the slot into
//!    its inbox, checks magic and generation, queues `(name, msg)` for the application,
//!    and answers with the data-less tag `ACK | slot | generation`.
//! 4. The sender frees and zeroes the slot on the ACK (only if the lease matches: a stale
//!    or foreign ACK frees nothing). Slots whose carrying batch failed, whose receiver
//!    went away, or that are older than [`SLOT_LEASE`] are reclaimed (and zeroed).
//!
//! A message is therefore delivered once (one tag per batch), after its data, and never
//! from a slot that was reused (the generation check drops such a read). Flow control is
//! the slot count: a receiver whose application does not drain its queue stops reading
//! after [`QUEUE_MAX`] notifications, so its senders run out of slots
//! ([`Code::TooManyRequests`]) instead of either side growing without bound. Any engine
//! connected to the sender can read its outbox: notification text is visible to the
//! sender's other peers while it is in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use pagewire_transport::{
    Access, Batch, BatchStatus, Engine, HostBuffer, PeerId, RemoteRegion, TransferHandle,
};

use crate::code::{Code, Error, fail};
use crate::lock;

/// Slots in one engine's outbox (its notifications in flight, all peers together).
pub const SLOTS: usize = 256;
/// Bytes per slot.
pub const SLOT_BYTES: usize = 8192;
/// The outbox's size, which is how peers recognise it.
pub const OUTBOX_BYTES: usize = SLOTS * SLOT_BYTES;
/// Header of a message in a slot: magic, generation, name length, msg length.
const HEADER: usize = 16;
/// Largest `name.len() + msg.len()` of one notification.
pub const MAX_NOTIFY_BYTES: usize = SLOT_BYTES - HEADER;
const MAGIC: u32 = u32::from_le_bytes(*b"PWNM");

const KIND_MASK: u32 = 0b11 << 30;
const KIND_MSG: u32 = 0b10 << 30;
const KIND_ACK: u32 = 0b11 << 30;
const GEN_BITS: u32 = 22;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

/// How long a READ of a peer's slot may take.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A slot held longer than this is reclaimed (its receiver never answered).
pub const SLOT_LEASE: Duration = Duration::from_secs(120);
/// Received notifications queued for the application, at most.
pub const QUEUE_MAX: usize = 4096;
/// A peer found without an outbox is not asked again within this.
const MISSING_RETRY: Duration = Duration::from_secs(1);

/// A decoded tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    /// A message in the sender's outbox.
    Msg { slot: usize, generation: u32 },
    /// The receiver read the message in `slot` with this generation.
    Ack { slot: usize, generation: u32 },
    /// Not a notification tag (a native pagewire peer's).
    Other(u32),
}

fn encode(kind: u32, slot: usize, generation: u32) -> u32 {
    debug_assert!(slot < SLOTS);
    kind | ((slot as u32) << GEN_BITS) | (generation & GEN_MASK)
}

pub(crate) fn decode(tag: u32) -> Tag {
    let slot = ((tag & !KIND_MASK) >> GEN_BITS) as usize;
    let generation = tag & GEN_MASK;
    match tag & KIND_MASK {
        KIND_MSG => Tag::Msg { slot, generation },
        KIND_ACK => Tag::Ack { slot, generation },
        _ => Tag::Other(tag),
    }
}

/// A slot that holds an outgoing notification, until its batch is posted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Staged {
    slot: usize,
    generation: u32,
}

impl Staged {
    /// The tag the carrying batch must use.
    pub(crate) fn tag(&self) -> u32 {
        encode(KIND_MSG, self.slot, self.generation)
    }
}

/// A lease on a slot, until ACKed or reclaimed.
#[derive(Debug)]
struct Held {
    peer: PeerId,
    generation: u32,
    since: Instant,
    /// The batch carrying the tag: its failure frees the slot.
    carrier: Option<TransferHandle>,
}

/// The outbox memory and its slot table, under one lock: a slot is written only by the
/// thread that leases, frees or reclaims it, with the lock held.
#[derive(Debug)]
struct Outbox {
    buf: HostBuffer,
    held: Vec<Option<Held>>,
    next_generation: u32,
}

impl Outbox {
    fn zero(&mut self, slot: usize) {
        self.buf
            .fill_range(slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES, 0);
    }

    /// Frees the slots whose carrying batch failed, whose receiver is gone, or that
    /// outlived the lease. Returns whether any was freed.
    fn reclaim(&mut self, engine: &Engine, now: Instant) -> bool {
        let mut any = false;
        for slot in 0..SLOTS {
            let stale = self.held[slot].as_ref().is_some_and(|h| {
                matches!(
                    h.carrier.as_ref().map(TransferHandle::status),
                    Some(BatchStatus::Failed(_) | BatchStatus::Cancelled)
                ) || !engine.peer_alive(h.peer).unwrap_or(false)
                    || now.duration_since(h.since) > SLOT_LEASE
            });
            if stale {
                self.held[slot] = None;
                // Peers can read the outbox: the text does not stay there.
                self.zero(slot);
                any = true;
            }
        }
        any
    }
}

/// One engine's mailbox: its outbox and inbox, and the queue of received notifications.
#[derive(Debug)]
pub(crate) struct Mailbox {
    out: Mutex<Outbox>,
    freed: Condvar,
    /// Written by READs of the worker thread only, read by it after they completed.
    inbox: HostBuffer,
    queue: Mutex<VecDeque<(Vec<u8>, Vec<u8>)>>,
    /// Pokes the worker when the application drained the queue.
    wake: Sender<()>,
    wake_rx: Receiver<()>,
}

impl Mailbox {
    /// Allocates both boxes and registers them with `engine`: the outbox readable by
    /// peers, the inbox private. The engine keeps the memory alive while registered.
    pub(crate) fn new(engine: &Engine) -> pagewire_transport::Result<Mailbox> {
        let outbox = HostBuffer::new(OUTBOX_BYTES)?;
        let inbox = HostBuffer::new(SLOT_BYTES)?;
        engine.register(&outbox, Access::REMOTE_READ)?;
        engine.register(&inbox, Access::LOCAL_WRITE)?;
        let (wake, wake_rx) = crossbeam_channel::bounded(1);
        Ok(Mailbox {
            out: Mutex::new(Outbox {
                buf: outbox,
                held: (0..SLOTS).map(|_| None).collect(),
                next_generation: 1,
            }),
            freed: Condvar::new(),
            inbox,
            queue: Mutex::new(VecDeque::new()),
            wake,
            wake_rx,
        })
    }

    // ------------------------------------------------------------------ sending

    /// Writes a notification into a free slot for `peer`, waiting until `until` for one
    /// (reclaiming slots of peers that went away meanwhile).
    pub(crate) fn stage(
        &self,
        engine: &Engine,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        until: Instant,
    ) -> Result<Staged, Error> {
        let size = name.len() + msg.len();
        if size > MAX_NOTIFY_BYTES {
            return fail(
                Code::InvalidArgument,
                format!("notification of {size} bytes (name + msg) exceeds {MAX_NOTIFY_BYTES}"),
            );
        }
        let mut out = lock(&self.out);
        let slot = loop {
            if let Some(i) = out.held.iter().position(Option::is_none) {
                break i;
            }
            if out.reclaim(engine, Instant::now()) {
                continue;
            }
            let now = Instant::now();
            if now >= until {
                return fail(
                    Code::TooManyRequests,
                    format!(
                        "all {SLOTS} notification slots are in flight (receivers are not reading)"
                    ),
                );
            }
            out = self
                .freed
                .wait_timeout(out, (until - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        let generation = out.next_generation & GEN_MASK;
        out.next_generation = out.next_generation.wrapping_add(1);
        out.buf
            .write_at(slot * SLOT_BYTES, &encode_slot(generation, name, msg));
        out.held[slot] = Some(Held {
            peer,
            generation,
            since: Instant::now(),
            carrier: None,
        });
        Ok(Staged { slot, generation })
    }

    /// Records the batch that carries a staged notification (its failure frees the slot).
    pub(crate) fn attach(&self, staged: Staged, carrier: TransferHandle) {
        let mut out = lock(&self.out);
        if let Some(h) = out.held[staged.slot].as_mut()
            && h.generation == staged.generation
        {
            h.carrier = Some(carrier);
        }
    }

    /// Frees a staged slot whose batch failed or was never posted (a tag that still
    /// arrives reads a zeroed slot, which the generation check drops).
    pub(crate) fn release(&self, staged: Staged) {
        self.free(None, staged.slot, staged.generation);
    }

    /// Frees a slot if its lease is `generation`'s (and `peer`'s, when given), zeroing it.
    fn free(&self, peer: Option<PeerId>, slot: usize, generation: u32) {
        let mut out = lock(&self.out);
        let matches = out
            .held
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|h| h.generation == generation && peer.is_none_or(|p| p == h.peer));
        if matches {
            out.held[slot] = None;
            out.zero(slot);
            self.freed.notify_all();
        }
    }

    /// Sends a notification alone and waits until the peer's engine has it (or
    /// `deadline`).
    pub(crate) fn send(
        &self,
        engine: &Engine,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        deadline: Instant,
    ) -> Result<(), Error> {
        let staged = self.stage(engine, peer, name, msg, deadline)?;
        let batch = Batch::new().notify(staged.tag()).deadline(deadline);
        let h = match engine.submit(peer, batch) {
            Ok(h) => h,
            Err(e) => {
                self.release(staged);
                return Err(Error::transport("sending a notification", e));
            }
        };
        self.attach(staged, h.clone());
        match h.wait(deadline) {
            Ok(_) => Ok(()),
            Err(e) => {
                h.cancel();
                self.release(staged);
                Err(Error::transport("sending a notification", e))
            }
        }
    }

    // ------------------------------------------------------------------ receiving

    /// Takes every received notification, and lets the worker read more.
    pub(crate) fn drain(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let out: Vec<_> = lock(&self.queue).drain(..).collect();
        let _ = self.wake.try_send(());
        out
    }

    /// Whether the application has drained enough for the worker to read more.
    pub(crate) fn has_room(&self) -> bool {
        lock(&self.queue).len() < QUEUE_MAX
    }

    /// Fires when the application drained the queue.
    pub(crate) fn woken(&self) -> &Receiver<()> {
        &self.wake_rx
    }

    /// An ACK from `peer`: frees its slot.
    pub(crate) fn acked(&self, peer: PeerId, slot: usize, generation: u32) {
        self.free(Some(peer), slot, generation);
    }

    /// Reclaims slots (see [`Outbox::reclaim`]); wakes senders waiting for one.
    pub(crate) fn sweep(&self, engine: &Engine) {
        if lock(&self.out).reclaim(engine, Instant::now()) {
            self.freed.notify_all();
        }
    }

    /// Reads and queues the message a MSG tag from `peer` points at, then ACKs it.
    /// Worker thread only. `Err` says why the message was dropped.
    pub(crate) fn receive(
        &self,
        engine: &Engine,
        boxes: &mut PeerBoxes,
        peer: PeerId,
        slot: usize,
        generation: u32,
    ) -> Result<(), String> {
        let base = boxes
            .lookup(engine, peer)
            .ok_or("the sender exposes no notification outbox")?;
        let deadline = Instant::now() + IO_TIMEOUT;
        let read = Batch::new()
            .read(
                self.inbox.addr(),
                base + (slot * SLOT_BYTES) as u64,
                SLOT_BYTES as u64,
            )
            .deadline(deadline);
        engine
            .submit(peer, read)
            .and_then(|h| h.wait(deadline))
            .map_err(|e| format!("reading the message: {e}"))?;
        // The READ has completed and no peer can write the inbox (LOCAL_WRITE only).
        let raw = self.inbox.read_vec(..);
        // The slot can be reused now, whatever it held; the ACK is not waited for.
        let ack = Batch::new()
            .notify(encode(KIND_ACK, slot, generation))
            .timeout(IO_TIMEOUT);
        if let Err(e) = engine.submit(peer, ack) {
            tracing::warn!(%peer, error = %e, "acknowledging a notification failed");
        }
        let m = parse(&raw, generation).ok_or_else(|| {
            format!("malformed or stale message in slot {slot} (generation {generation})")
        })?;
        lock(&self.queue).push_back(m);
        Ok(())
    }
}

/// The receiver's cache of where each peer's outbox is (worker thread only).
#[derive(Debug, Default)]
pub(crate) struct PeerBoxes {
    found: HashMap<PeerId, u64>,
    /// Peers found without one, and when: not asked again within [`MISSING_RETRY`], so a
    /// peer without an outbox cannot keep the worker busy re-describing it.
    missing: HashMap<PeerId, Instant>,
}

impl PeerBoxes {
    fn lookup(&mut self, engine: &Engine, peer: PeerId) -> Option<u64> {
        if let Some(&a) = self.found.get(&peer) {
            return Some(a);
        }
        if self
            .missing
            .get(&peer)
            .is_some_and(|t| t.elapsed() < MISSING_RETRY)
        {
            return None;
        }
        // The transport publishes a peer on both sides before `connect` returns, so a
        // notification never names a peer this engine does not know. An outbox
        // registered after the handshake needs the peer asked again.
        let found = engine
            .peer_regions(peer)
            .ok()
            .and_then(|r| find_outbox(&r))
            .or_else(|| engine.redescribe(peer).ok().and_then(|r| find_outbox(&r)));
        match found {
            Some(a) => {
                self.found.insert(peer, a);
            }
            None => {
                self.missing.insert(peer, Instant::now());
            }
        }
        found
    }

    /// Forgets peers whose connection is gone, and old misses.
    pub(crate) fn prune(&mut self, engine: &Engine) {
        self.found
            .retain(|p, _| engine.peer_alive(*p).unwrap_or(false));
        self.missing.retain(|_, t| t.elapsed() < MISSING_RETRY);
    }
}

/// The start of a peer's outbox: a run of adjacent READ-only regions of exactly
/// [`OUTBOX_BYTES`] (one region, unless the backend's MR limit split it).
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

/// A slot's bytes: the header (magic, generation, name length, msg length) and the
/// strings.
fn encode_slot(generation: u32, name: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER + name.len() + msg.len());
    bytes.extend_from_slice(&MAGIC.to_le_bytes());
    bytes.extend_from_slice(&generation.to_le_bytes());
    bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(msg);
    bytes
}

/// Decodes a slot read from a peer; `None` unless it holds a message of `generation`.
fn parse(bytes: &[u8], generation: u32) -> Option<(Vec<u8>, Vec<u8>)> {
    if bytes.len() < HEADER {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC || word(4) != generation {
        return None;
    }
    let (n, m) = (word(8) as usize, word(12) as usize);
    if n.checked_add(m)? > bytes.len() - HEADER {
        return None;
    }
    Some((
        bytes[HEADER..HEADER + n].to_vec(),
        bytes[HEADER + n..HEADER + n + m].to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_transport::{BackendKind, EngineConfig};

    #[test]
    fn tags_round_trip() {
        for (slot, generation) in [(0, 0), (255, GEN_MASK), (17, 12345)] {
            assert_eq!(
                decode(encode(KIND_MSG, slot, generation)),
                Tag::Msg { slot, generation }
            );
            assert_eq!(
                decode(encode(KIND_ACK, slot, generation)),
                Tag::Ack { slot, generation }
            );
        }
        assert_eq!(
            decode(42),
            Tag::Other(42),
            "plain small tags are neither kind"
        );
        assert_eq!(decode(1 << 30), Tag::Other(1 << 30));
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
        s[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse(&s, 9), None, "lengths overflow");
        s[..4].copy_from_slice(b"HTTP");
        assert_eq!(parse(&s, 9), None, "bad magic");
        assert_eq!(parse(&s[..8], 9), None, "short");
    }

    proptest::proptest! {
        /// Any bytes a peer's slot may hold decode to a message inside the slot or to
        /// nothing, never a panic; what a sender writes decodes to itself, only under
        /// its generation.
        #[test]
        fn slots_decode_safely(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            header in proptest::collection::vec(proptest::prelude::any::<u32>(), 4),
            name in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..100),
            msg in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000),
            generation in 0..GEN_MASK,
        ) {
            let _ = parse(&junk, generation);
            let mut slot: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
            slot.extend_from_slice(&junk);
            slot.resize(SLOT_BYTES, 0);
            if let Some((n, m)) = parse(&slot, header[1]) {
                proptest::prop_assert!(n.len() + m.len() <= SLOT_BYTES - HEADER);
            }
            let mut sent = encode_slot(generation, &name, &msg);
            sent.resize(SLOT_BYTES, 0);
            proptest::prop_assert_eq!(parse(&sent, generation), Some((name, msg)));
            proptest::prop_assert_eq!(parse(&sent, generation.wrapping_add(1)), None);
        }
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

    /// A slot's life: staged (text in the outbox, under a lease), freed by the matching
    /// ACK only (and zeroed), reused with a new generation; all slots taken means
    /// `TooManyRequests` at the deadline; a lease of a peer that went away is reclaimed.
    #[test]
    fn slot_lifecycle() {
        let cfg = EngineConfig::builder()
            .backend(BackendKind::Loopback)
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap();
        let a = Engine::new(cfg.clone()).unwrap();
        let b = Engine::new(cfg.clone()).unwrap();
        let c = Engine::new(cfg).unwrap();
        let mb = Mailbox::new(&a).unwrap();
        let peer = a.connect(b.local_addr()).unwrap();
        let other = a.connect(c.local_addr()).unwrap();
        let soon = Instant::now() + Duration::from_millis(20);
        let slot_text = |mb: &Mailbox, s: usize| {
            lock(&mb.out)
                .buf
                .read_vec(s * SLOT_BYTES..s * SLOT_BYTES + 24)
        };

        let s = mb.stage(&a, peer, b"nm", b"hello", soon).unwrap();
        let msg = |slot, generation| Tag::Msg { slot, generation };
        assert_eq!(decode(s.tag()), msg(0, 1));
        assert_eq!(&slot_text(&mb, 0)[16..23], b"nmhello");
        mb.acked(peer, 0, 2); // wrong generation: nothing freed
        mb.acked(other, 0, 1); // wrong peer: nothing freed
        assert!(lock(&mb.out).held[0].is_some());
        mb.acked(peer, 0, 1);
        assert!(lock(&mb.out).held[0].is_none());
        assert!(slot_text(&mb, 0).iter().all(|&b| b == 0), "zeroed on ACK");

        let again = mb.stage(&a, peer, b"", b"x", soon).unwrap();
        assert_eq!(decode(again.tag()), msg(0, 2), "a new generation");
        for _ in 1..SLOTS {
            mb.stage(&a, peer, b"", b"x", soon).unwrap();
        }
        let full = mb.stage(
            &a,
            peer,
            b"",
            b"x",
            Instant::now() + Duration::from_millis(20),
        );
        assert_eq!(full.unwrap_err().code(), Code::TooManyRequests);
        let big = vec![b'x'; MAX_NOTIFY_BYTES + 1];
        assert_eq!(
            mb.stage(&a, peer, b"", &big, soon).unwrap_err().code(),
            Code::InvalidArgument
        );

        mb.release(again);
        assert!(lock(&mb.out).held[0].is_none(), "released");
        a.disconnect(peer).unwrap();
        mb.sweep(&a);
        assert!(
            lock(&mb.out).held.iter().all(Option::is_none),
            "leases of a gone peer reclaimed"
        );
        for e in [a, b, c] {
            e.shutdown();
        }
    }
}
