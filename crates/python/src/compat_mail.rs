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
//! 2. The sender writes `header + name + msg` into free outbox slots and submits its data
//!    batch with the tag `MSG(start, count, generation)`.
//! 3. The receiver's worker thread, on that tag (so after the data), READs the slots
//!    into its inbox, checks magic and generation, queues `(name, msg)` for
//!    `get_notifies`, and answers with the data-less tag `ACK(start, generation)`.
//! 4. The sender frees the slots on the ACK (only if the lease matches: a stale or
//!    foreign ACK frees nothing). Leases to peers whose connection broke are reclaimed
//!    when the outbox runs full.
//!
//! A message is therefore delivered once (one tag per batch), after its data, and never
//! from a slot that was reused (the generation check drops such a read).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use pagewire_transport::{Access, Batch, Engine, HostBuffer, PeerId};

/// Bytes per outbox slot.
pub(crate) const SLOT: usize = 4096;
/// Slots per outbox (a message may use several consecutive ones).
pub(crate) const SLOTS: usize = 256;
/// Outbox (and inbox) size.
pub(crate) const BOX_BYTES: usize = SLOT * SLOTS;
/// Header of a message in the outbox: magic, generation, name length, msg length.
const HEADER: usize = 16;
/// Largest `name + msg`, in bytes.
pub(crate) const MAX_MESSAGE: usize = BOX_BYTES - HEADER;
const MAGIC: u32 = u32::from_le_bytes(*b"PWNM");

/// Tags with this bit belong to the compat layer.
const COMPAT_BIT: u32 = 1 << 31;
/// Set for an ACK, clear for a MSG.
const ACK_BIT: u32 = 1 << 30;
const GEN_MASK: u32 = (1 << 14) - 1;

/// A decoded compat tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    /// A message in the sender's outbox: slots `start .. start + count`.
    Msg {
        start: usize,
        count: usize,
        generation: u32,
    },
    /// The receiver read the message at `start` with this generation.
    Ack { start: usize, generation: u32 },
    /// Not ours (a native pagewire peer's tag).
    Other(u32),
}

fn encode(ack: bool, start: usize, count: usize, generation: u32) -> u32 {
    debug_assert!(start < SLOTS && (1..=SLOTS).contains(&count));
    COMPAT_BIT
        | if ack { ACK_BIT } else { 0 }
        | (generation & GEN_MASK) << 16
        | ((count - 1) as u32) << 8
        | start as u32
}

pub(crate) fn decode(tag: u32) -> Tag {
    if tag & COMPAT_BIT == 0 {
        return Tag::Other(tag);
    }
    let start = (tag & 0xff) as usize;
    let count = ((tag >> 8) & 0xff) as usize + 1;
    let generation = (tag >> 16) & GEN_MASK;
    if tag & ACK_BIT != 0 {
        Tag::Ack { start, generation }
    } else {
        Tag::Msg {
            start,
            count,
            generation,
        }
    }
}

/// One message staged in the outbox, until ACKed or released.
#[derive(Debug, Clone, Copy)]
struct Lease {
    peer: PeerId,
    generation: u32,
    count: usize,
}

#[derive(Debug)]
struct OutState {
    /// The lease starting at each slot.
    leases: Vec<Option<Lease>>,
    /// Which slots are taken.
    used: Vec<bool>,
    next_gen: u32,
    cursor: usize,
}

impl OutState {
    fn find_run(&self, count: usize) -> Option<usize> {
        (0..SLOTS)
            .map(|i| (self.cursor + i) % SLOTS)
            .find(|&s| s + count <= SLOTS && self.used[s..s + count].iter().all(|u| !u))
    }

    fn free(&mut self, start: usize) {
        if let Some(l) = self.leases[start].take() {
            self.used[start..start + l.count].fill(false);
        }
    }
}

/// A message staged for one batch: its tag, and how to release it if the batch fails.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Staged {
    pub(crate) tag: u32,
    start: usize,
    generation: u32,
}

/// The outbox, the inbox, and the receiver's cache of peers' outbox addresses.
#[derive(Debug)]
pub(crate) struct Mailbox {
    outbox: HostBuffer,
    inbox: HostBuffer,
    state: Mutex<OutState>,
    freed: Condvar,
    /// Receiver side: where each peer's outbox is (worker thread only).
    peer_boxes: Mutex<HashMap<PeerId, u64>>,
}

impl Mailbox {
    /// Allocates both boxes and registers them with `engine` (outbox readable by peers,
    /// inbox private).
    pub(crate) fn new(engine: &Engine) -> pagewire_transport::Result<Mailbox> {
        let outbox = HostBuffer::new(BOX_BYTES)?;
        let inbox = HostBuffer::new(BOX_BYTES)?;
        engine.register(&outbox, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        engine.register(&inbox, Access::LOCAL_WRITE)?;
        Ok(Mailbox {
            outbox,
            inbox,
            state: Mutex::new(OutState {
                leases: vec![None; SLOTS],
                used: vec![false; SLOTS],
                next_gen: 1,
                cursor: 0,
            }),
            freed: Condvar::new(),
            peer_boxes: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `(name, msg)` into free slots for a batch to `peer`; waits for slots until
    /// `deadline`, reclaiming leases of peers that `alive` says are gone.
    pub(crate) fn stage(
        &self,
        peer: PeerId,
        name: &[u8],
        msg: &[u8],
        deadline: Instant,
        alive: impl Fn(PeerId) -> bool,
    ) -> Result<Staged, String> {
        let total = HEADER + name.len() + msg.len();
        if total > BOX_BYTES {
            return Err(format!(
                "notification of {} bytes exceeds the {MAX_MESSAGE}-byte limit",
                name.len() + msg.len()
            ));
        }
        let count = total.div_ceil(SLOT);
        let mut st = self.lock();
        let start = loop {
            if let Some(s) = st.find_run(count) {
                break s;
            }
            // Full: leases to broken connections will never be ACKed.
            let dead: Vec<usize> = (0..SLOTS)
                .filter(|&s| st.leases[s].is_some_and(|l| !alive(l.peer)))
                .collect();
            if !dead.is_empty() {
                for s in dead {
                    st.free(s);
                }
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(
                    "no free notification slot (receivers have not read earlier notifications)"
                        .into(),
                );
            }
            st = self
                .freed
                .wait_timeout(st, (deadline - now).min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        let generation = st.next_gen;
        st.next_gen = (st.next_gen + 1) & GEN_MASK;
        st.used[start..start + count].fill(true);
        st.leases[start] = Some(Lease {
            peer,
            generation,
            count,
        });
        st.cursor = (start + count) % SLOTS;
        let mut bytes = Vec::with_capacity(total);
        bytes.extend_from_slice(&MAGIC.to_le_bytes());
        bytes.extend_from_slice(&generation.to_le_bytes());
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(msg);
        // SAFETY: the slots `start..start+count` are leased to this call (under the lock),
        // so no other thread writes them, and peers may only read the outbox (it is
        // registered without REMOTE_WRITE). `total <= count * SLOT` bytes fit, and the
        // range lies inside the outbox allocation. A raw copy: no Rust reference is formed
        // to memory the NIC may be reading.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.outbox.as_mut_ptr().add(start * SLOT),
                total,
            )
        };
        Ok(Staged {
            tag: encode(false, start, count, generation),
            start,
            generation,
        })
    }

    /// Frees a staged message whose batch failed (its tag was not delivered, or will be
    /// dropped by the receiver's generation check once the slots are reused).
    pub(crate) fn release(&self, s: Staged) {
        let mut st = self.lock();
        if st.leases[s.start].is_some_and(|l| l.generation == s.generation) {
            st.free(s.start);
            self.freed.notify_all();
        }
    }

    /// An ACK from `peer`: frees the lease if it is that peer's and that generation's.
    fn on_ack(&self, peer: PeerId, start: usize, generation: u32) {
        let mut st = self.lock();
        if st.leases[start].is_some_and(|l| l.peer == peer && l.generation == generation) {
            st.free(start);
            self.freed.notify_all();
        }
    }

    /// Where `peer`'s outbox is: the start of a run of read-only exposed regions
    /// covering [`BOX_BYTES`] (one region, unless the MR limit split it).
    fn peer_box(&self, engine: &Engine, peer: PeerId) -> Option<u64> {
        if let Some(&a) = self
            .peer_boxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
        {
            return Some(a);
        }
        let find = |regions: Vec<pagewire_transport::RemoteRegion>| -> Option<u64> {
            let read_only =
                |a: Access| a.contains(Access::REMOTE_READ) && !a.contains(Access::REMOTE_WRITE);
            let mut i = 0;
            while i < regions.len() {
                if read_only(regions[i].access) {
                    let base = regions[i].addr;
                    let mut end = regions[i].end();
                    let mut j = i + 1;
                    while end - base < BOX_BYTES as u64
                        && j < regions.len()
                        && regions[j].addr == end
                        && read_only(regions[j].access)
                    {
                        end = regions[j].end();
                        j += 1;
                    }
                    if end - base == BOX_BYTES as u64 {
                        return Some(base);
                    }
                    i = j;
                } else {
                    i += 1;
                }
            }
            None
        };
        let mut regions = engine.peer_regions(peer).ok()?;
        regions.sort_by_key(|r| r.addr);
        let found = find(regions).or_else(|| {
            let mut r = crate::compat::redescribe(engine, peer).ok()?;
            r.sort_by_key(|r| r.addr);
            find(r)
        })?;
        self.peer_boxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer, found);
        Some(found)
    }

    /// Handles one notification on the receiver's worker thread. Returns a delivered
    /// `(name, msg)`, `Ok(None)` for tags that carry none, or why a message was dropped.
    pub(crate) fn on_tag(
        &self,
        engine: &Engine,
        peer: PeerId,
        tag: u32,
    ) -> Result<Option<(String, String)>, String> {
        match decode(tag) {
            Tag::Other(t) => Err(format!(
                "tag {t} from a peer that is not a Mooncake-compat engine"
            )),
            Tag::Ack { start, generation } => {
                self.on_ack(peer, start, generation);
                Ok(None)
            }
            Tag::Msg {
                start,
                count,
                generation,
            } => {
                if start + count > SLOTS {
                    return Err(format!("message slots {start}+{count} out of range"));
                }
                // A batch can complete on a connection that the accepting engine publishes
                // only a moment later (it reads the initiator's last handshake frame on
                // another thread): wait for the peer to be known before using it.
                let until = Instant::now() + Duration::from_secs(1);
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
                let len = (count * SLOT) as u64;
                let batch = Batch::new()
                    .read(self.inbox.addr(), base + (start * SLOT) as u64, len)
                    .timeout(Duration::from_secs(5));
                let h = engine.submit(peer, batch).map_err(|e| e.to_string())?;
                h.wait(Instant::now() + Duration::from_secs(5))
                    .map_err(|e| format!("reading the message: {e}"))?;
                let mut raw = vec![0u8; count * SLOT];
                // SAFETY: the inbox is registered LOCAL_WRITE only (no peer can write it),
                // and the only writer, the READ above, has completed; this thread is the
                // inbox's only user. `raw` has exactly `count * SLOT <= BOX_BYTES` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.inbox.as_mut_ptr(),
                        raw.as_mut_ptr(),
                        raw.len(),
                    )
                };
                let word =
                    |i: usize| u32::from_le_bytes(raw[i..i + 4].try_into().expect("4 bytes"));
                let (magic, g, nl, ml) = (word(0), word(4), word(8) as usize, word(12) as usize);
                // The peer has read it (or it is garbage): either way the slots may go.
                let _ = engine.submit(
                    peer,
                    Batch::new().notify(encode(true, start, count, generation)),
                );
                if magic != MAGIC || g != generation {
                    return Err(format!(
                        "stale or foreign message in slots {start}+{count} (generation {g}, expected {generation})"
                    ));
                }
                if HEADER + nl + ml > raw.len() {
                    return Err(format!(
                        "message lengths {nl}+{ml} exceed its {count} slots"
                    ));
                }
                let name = String::from_utf8_lossy(&raw[HEADER..HEADER + nl]).into_owned();
                let msg = String::from_utf8_lossy(&raw[HEADER + nl..HEADER + nl + ml]).into_owned();
                Ok(Some((name, msg)))
            }
        }
    }

    /// Forgets a peer's outbox address (the connection went away).
    pub(crate) fn forget_peer(&self, peer: PeerId) {
        self.peer_boxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        for (start, count, generation) in [(0, 1, 1), (255, 1, GEN_MASK), (3, 253, 77), (0, 256, 0)]
        {
            let t = encode(false, start, count, generation);
            assert_eq!(
                decode(t),
                Tag::Msg {
                    start,
                    count,
                    generation
                }
            );
            let a = encode(true, start, count, generation);
            assert_eq!(decode(a), Tag::Ack { start, generation });
        }
        assert_eq!(decode(42), Tag::Other(42));
    }

    #[test]
    fn runs_do_not_wrap_and_respect_used_slots() {
        let mut st = OutState {
            leases: vec![None; SLOTS],
            used: vec![false; SLOTS],
            next_gen: 1,
            cursor: SLOTS - 1,
        };
        assert_eq!(st.find_run(2), Some(0));
        st.used[0] = true;
        assert_eq!(st.find_run(2), Some(1));
        st.used.fill(true);
        assert_eq!(st.find_run(1), None);
    }
}
