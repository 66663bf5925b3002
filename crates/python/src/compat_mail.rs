//! Mooncake-style notifications (`TransferNotify(name, msg)`) over pagewire's 32-bit
//! batch tags.
//!
//! pagewire's transport surfaces a batch's tag on the receiving engine only once every
//! byte of the batch is in its memory. Mooncake's notifications carry two strings, so the
//! strings travel through memory the receiver reads, and the tag says where:
//!
//! 1. Each compat engine registers an *outbox* of [`SLOTS`] x [`SLOT`] bytes that peers
//!    may read but not write (the only region a compat engine exposes read-only, which is
//!    how a receiver finds it among the sender's regions), and a private *inbox*.
//! 2. The sender writes `header + name + msg` into a free slot and submits its data batch
//!    with the tag `MSG | slot | generation`.
//! 3. The receiver's worker thread, on that tag (so after the data), READs the slot into
//!    its inbox, checks magic and generation, queues `(name, msg)` for `get_notifies`,
//!    and answers with the data-less tag `ACK | slot | generation`.
//! 4. The sender frees the slot on the ACK (only if the lease matches: a stale or foreign
//!    ACK frees nothing) and zeroes it. Leases to peers whose connection broke, and
//!    leases older than [`SLOT_LEASE`], are reclaimed.
//!
//! A message is therefore delivered once (one tag per batch), after its data, and never
//! from a slot that was reused (the generation check drops such a read). A receiver whose
//! application does not call `get_notifies` stops reading after [`QUEUE_MAX`] queued
//! notifications, so its senders run out of slots instead of either side growing.
//!
//! The layout (slot size and count, header, tag bits) is the one of the C ABI's
//! `libtransfer_engine.so` (`crates/capi`), so that the two kinds of engines can notify
//! each other (not yet tested together).

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use pagewire_transport::{Access, Batch, Engine, HostBuffer, PeerId};

/// Bytes per outbox slot.
pub(crate) const SLOT: usize = 8192;
/// Slots per outbox.
pub(crate) const SLOTS: usize = 256;
/// Outbox size (how peers recognise it).
pub(crate) const BOX_BYTES: usize = SLOT * SLOTS;
/// Header of a message in a slot: magic, generation, name length, msg length.
const HEADER: usize = 16;
/// Largest `name + msg`, in bytes.
pub(crate) const MAX_MESSAGE: usize = SLOT - HEADER;
const MAGIC: u32 = u32::from_le_bytes(*b"PWNM");

const KIND_MASK: u32 = 0b11 << 30;
const KIND_MSG: u32 = 0b10 << 30;
const KIND_ACK: u32 = 0b11 << 30;
const GEN_BITS: u32 = 22;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

/// How long reading a peer's slot may take.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A slot held longer than this is reclaimed (its receiver never answered).
const SLOT_LEASE: Duration = Duration::from_secs(120);
/// Received notifications queued for the application, at most.
pub(crate) const QUEUE_MAX: usize = 4096;

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

/// A slot that holds an outgoing notification, until ACKed or reclaimed.
#[derive(Debug, Clone, Copy)]
struct Lease {
    peer: PeerId,
    generation: u32,
    since: Instant,
}

#[derive(Debug)]
struct OutState {
    leases: Vec<Option<Lease>>,
    next_gen: u32,
}

/// A message staged for one batch: its tag, and how to release it if the batch fails.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Staged {
    pub(crate) tag: u32,
    slot: usize,
    generation: u32,
}

/// The outbox, the inbox, the queue of received notifications, and the receiver's cache
/// of peers' outbox addresses.
#[derive(Debug)]
pub(crate) struct Mailbox {
    outbox: HostBuffer,
    inbox: HostBuffer,
    state: Mutex<OutState>,
    freed: Condvar,
    /// Received `(name, msg)`, drained by `get_notifies`.
    queue: Mutex<VecDeque<(String, String)>>,
    /// Receiver side, worker thread only: where each peer's outbox is, and peers found
    /// without one (not asked again within a second).
    peer_boxes: Mutex<HashMap<PeerId, u64>>,
    missing: Mutex<HashMap<PeerId, Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Mailbox {
    /// Allocates both boxes and registers them with `engine` (the outbox readable by
    /// peers, the inbox private).
    pub(crate) fn new(engine: &Engine) -> pagewire_transport::Result<Mailbox> {
        let outbox = HostBuffer::new(BOX_BYTES)?;
        let inbox = HostBuffer::new(SLOT)?;
        engine.register(&outbox, Access::REMOTE_READ)?;
        engine.register(&inbox, Access::LOCAL_WRITE)?;
        Ok(Mailbox {
            outbox,
            inbox,
            state: Mutex::new(OutState {
                leases: vec![None; SLOTS],
                next_gen: 1,
            }),
            freed: Condvar::new(),
            queue: Mutex::new(VecDeque::new()),
            peer_boxes: Mutex::new(HashMap::new()),
            missing: Mutex::new(HashMap::new()),
        })
    }

    /// Writes `bytes` at `off` of the outbox.
    fn write_outbox(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= BOX_BYTES, "outbox write out of range");
        // SAFETY: the range lies inside the outbox allocation (checked above), which
        // lives as long as `self`; the slot is leased to the caller (under the state
        // lock), so no other thread writes it, and peers may only read the outbox (it is
        // registered without REMOTE_WRITE). A raw copy: no Rust reference is formed to
        // memory the NIC may be reading.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.outbox.as_mut_ptr().add(off),
                bytes.len(),
            )
        };
    }

    /// Reclaims leases of peers that `alive` says are gone and leases past their term.
    fn reclaim(&self, st: &mut OutState, alive: &dyn Fn(PeerId) -> bool) -> bool {
        let now = Instant::now();
        let mut any = false;
        for slot in 0..SLOTS {
            if st.leases[slot]
                .is_some_and(|l| !alive(l.peer) || now.duration_since(l.since) > SLOT_LEASE)
            {
                st.leases[slot] = None;
                self.write_outbox(slot * SLOT, &[0u8; HEADER]);
                any = true;
            }
        }
        any
    }

    /// Writes `(name, msg)` into a free slot for a batch to `peer`; waits for a slot
    /// until `deadline`, reclaiming leases of peers that `alive` says are gone.
    pub(crate) fn stage(
        &self,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        deadline: Instant,
        alive: impl Fn(PeerId) -> bool,
    ) -> Result<Staged, String> {
        if name.len() + msg.len() > MAX_MESSAGE {
            return Err(format!(
                "notification of {} bytes (name + msg) exceeds {MAX_MESSAGE}",
                name.len() + msg.len()
            ));
        }
        let mut st = lock(&self.state);
        let slot = loop {
            if let Some(i) = st.leases.iter().position(Option::is_none) {
                break i;
            }
            if self.reclaim(&mut st, &alive) {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "all {SLOTS} notification slots are in flight (receivers are not reading)"
                ));
            }
            st = self
                .freed
                .wait_timeout(st, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        let generation = st.next_gen & GEN_MASK;
        st.next_gen = st.next_gen.wrapping_add(1);
        st.leases[slot] = Some(Lease {
            peer,
            generation,
            since: Instant::now(),
        });
        let mut bytes = Vec::with_capacity(HEADER + name.len() + msg.len());
        bytes.extend_from_slice(&MAGIC.to_le_bytes());
        bytes.extend_from_slice(&generation.to_le_bytes());
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(msg);
        self.write_outbox(slot * SLOT, &bytes);
        Ok(Staged {
            tag: encode(KIND_MSG, slot, generation),
            slot,
            generation,
        })
    }

    /// Frees a slot if its lease is `generation`'s (and `peer`'s, when given), zeroing
    /// it: peers can read the outbox, so the text does not stay there.
    fn free(&self, peer: Option<PeerId>, slot: usize, generation: u32) {
        let mut st = lock(&self.state);
        if st
            .leases
            .get(slot)
            .copied()
            .flatten()
            .is_some_and(|l| l.generation == generation && peer.is_none_or(|p| p == l.peer))
        {
            st.leases[slot] = None;
            self.write_outbox(slot * SLOT, &[0u8; SLOT]);
            self.freed.notify_all();
        }
    }

    /// Frees a staged message whose batch failed (its tag was not delivered, or will be
    /// dropped by the receiver's generation check).
    pub(crate) fn release(&self, s: Staged) {
        self.free(None, s.slot, s.generation);
    }

    /// Whether the application has drained enough for the worker to read more.
    pub(crate) fn has_room(&self) -> bool {
        lock(&self.queue).len() < QUEUE_MAX
    }

    /// Takes every received notification.
    pub(crate) fn drain(&self) -> Vec<(String, String)> {
        lock(&self.queue).drain(..).collect()
    }

    /// Where `peer`'s outbox is: the start of a run of read-only exposed regions of
    /// exactly [`BOX_BYTES`] (one region, unless the MR limit split it).
    fn peer_box(&self, engine: &Engine, peer: PeerId) -> Option<u64> {
        if let Some(&a) = lock(&self.peer_boxes).get(&peer) {
            return Some(a);
        }
        if lock(&self.missing)
            .get(&peer)
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return None;
        }
        let found = engine
            .peer_regions(peer)
            .ok()
            .and_then(|r| find_outbox(&r))
            .or_else(|| engine.redescribe(peer).ok().and_then(|r| find_outbox(&r)));
        match found {
            Some(a) => {
                lock(&self.peer_boxes).insert(peer, a);
                Some(a)
            }
            None => {
                lock(&self.missing).insert(peer, Instant::now());
                None
            }
        }
    }

    /// Handles one notification on the worker thread: frees a slot on an ACK, reads and
    /// queues a message on a MSG. `Err` says why a message was dropped.
    pub(crate) fn on_tag(&self, engine: &Engine, peer: PeerId, tag: u32) -> Result<(), String> {
        let (slot, generation) = match decode(tag) {
            Tag::Other(t) => return Err(format!("tag {t:#x} is not a notification")),
            Tag::Ack { slot, generation } => {
                self.free(Some(peer), slot, generation);
                return Ok(());
            }
            Tag::Msg { slot, generation } => (slot, generation),
        };
        // A batch can complete on a connection that the accepting engine publishes only a
        // moment later (it reads the initiator's last handshake frame on another thread):
        // wait for the peer to be known before using it.
        let until = Instant::now() + IO_TIMEOUT;
        while matches!(
            engine.peer_info(peer),
            Err(pagewire_transport::Error::UnknownPeer { .. })
        ) && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let base = self
            .peer_box(engine, peer)
            .ok_or("the sender exposes no notification outbox")?;
        let deadline = Instant::now() + IO_TIMEOUT;
        let batch = Batch::new()
            .read(self.inbox.addr(), base + (slot * SLOT) as u64, SLOT as u64)
            .deadline(deadline);
        engine
            .submit(peer, batch)
            .and_then(|h| h.wait(deadline))
            .map_err(|e| format!("reading the message: {e}"))?;
        let mut raw = vec![0u8; SLOT];
        // SAFETY: the inbox is registered LOCAL_WRITE only (no peer can write it), and its
        // only writer, the READ above, has completed; this thread is the inbox's only
        // user. `raw` has exactly the inbox's length.
        unsafe { std::ptr::copy_nonoverlapping(self.inbox.as_mut_ptr(), raw.as_mut_ptr(), SLOT) };
        // The slot may be reused now, whatever it held; the ACK is not waited for.
        let _ = engine.submit(
            peer,
            Batch::new()
                .notify(encode(KIND_ACK, slot, generation))
                .timeout(IO_TIMEOUT),
        );
        let (name, msg) = parse(&raw, generation).ok_or_else(|| {
            format!("malformed or stale message in slot {slot} (generation {generation})")
        })?;
        lock(&self.queue).push_back((
            String::from_utf8_lossy(&name).into_owned(),
            String::from_utf8_lossy(&msg).into_owned(),
        ));
        Ok(())
    }

    /// Forgets a peer's outbox address (the connection went away).
    pub(crate) fn forget_peer(&self, peer: PeerId) {
        lock(&self.peer_boxes).remove(&peer);
        lock(&self.missing).remove(&peer);
    }
}

/// The start of a run of adjacent read-only regions of exactly [`BOX_BYTES`].
fn find_outbox(regions: &[pagewire_transport::RemoteRegion]) -> Option<u64> {
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
            && end - start == BOX_BYTES as u64
        {
            return Some(start);
        }
    }
    None
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
    use pagewire_transport::RemoteRegion;

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
        assert_eq!(decode(42), Tag::Other(42));
        assert_eq!(decode(1 << 30), Tag::Other(1 << 30));
    }

    #[test]
    fn parse_refuses_hostile_slots() {
        let mut s = vec![0u8; SLOT];
        s[..4].copy_from_slice(&MAGIC.to_le_bytes());
        s[4..8].copy_from_slice(&9u32.to_le_bytes());
        s[8..12].copy_from_slice(&2u32.to_le_bytes());
        s[12..16].copy_from_slice(&3u32.to_le_bytes());
        s[16..21].copy_from_slice(b"abxyz");
        assert_eq!(parse(&s, 9), Some((b"ab".to_vec(), b"xyz".to_vec())));
        assert_eq!(parse(&s, 8), None);
        s[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse(&s, 9), None);
        s[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse(&s, 9), None);
        s[..4].copy_from_slice(b"HTTP");
        assert_eq!(parse(&s, 9), None);
        assert_eq!(parse(&s[..8], 9), None);
    }

    #[test]
    fn outbox_is_the_read_only_run_of_the_right_size() {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let half = (BOX_BYTES / 2) as u64;
        let regions = [
            RemoteRegion::new(0x10_0000, BOX_BYTES as u64, 1, rw),
            RemoteRegion::new(0x100_0000 + half, half, 3, Access::REMOTE_READ),
            RemoteRegion::new(0x100_0000, half, 2, Access::REMOTE_READ),
        ];
        assert_eq!(find_outbox(&regions), Some(0x100_0000));
        assert_eq!(find_outbox(&regions[..2]), None);
    }
}
