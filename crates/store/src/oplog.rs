//! The op-log's records: what a leading master changes that a standby must know, as typed
//! values ([`Record`]) and as a compact, versioned binary encoding.
//!
//! [`crate::core::MasterCore`] emits records into an outbox when logging is on; the server
//! drains it after each request and hands the records to a [`Journal`] (in `pagewire-ha`:
//! etcd), which must commit them before the reply goes out. A standby applies the records
//! in order ([`crate::core::MasterCore::apply`]). A snapshot is a list of records too: a
//! `Mount` per segment and a `Publish` per object.
//!
//! The decoder treats its input as hostile (it comes from etcd, which anyone with access
//! to it can write): lengths and counts are bounded, and every failure is a typed
//! [`DecodeError`].

use std::time::Instant;

use crate::proto::{MAX_ENDPOINT, MAX_KEY_LEN, MAX_REPLICAS, Pin};

/// Version byte that starts every encoded batch. Version 2 added the owner's client id to
/// `Mount`; batches of version 1 are refused ([`DecodeError::Version`]).
pub const VERSION: u8 = 2;

/// Most records in one encoded batch.
pub const MAX_RECORDS: usize = 1 << 20;

/// The shortest record: a removal of a one-byte key (tag, length, key).
const MIN_RECORD: usize = 4;

/// One change of the master's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A segment was mounted (or exists, in a snapshot).
    Mount {
        /// The master's id of the segment.
        segment: u64,
        /// The owner's transport endpoint.
        endpoint: String,
        /// Address of its first byte in the owner's memory.
        base: u64,
        /// Usable bytes.
        size: u64,
        /// The remote key of the owner's registration.
        rkey: u32,
        /// The master's id of the client that mounted it: after a failover only that
        /// client may take the segment back with its contents.
        owner: u64,
    },
    /// A segment awaiting its owner after a failover was mounted again by that owner
    /// under a new registration.
    Remount {
        /// The segment's id (unchanged).
        segment: u64,
        /// The new registration's remote key.
        rkey: u32,
    },
    /// A segment was unmounted: its replicas are gone.
    Unmount {
        /// The segment's id.
        segment: u64,
    },
    /// An object became readable (or exists, in a snapshot).
    Publish {
        /// Its key.
        key: Vec<u8>,
        /// Its length in bytes.
        size: u64,
        /// Its eviction protection.
        pin: Pin,
        /// `(segment, offset in the segment)` of each replica.
        replicas: Vec<(u64, u64)>,
    },
    /// An object was removed or evicted.
    Remove {
        /// Its key.
        key: Vec<u8>,
    },
}

/// Why bytes are not a valid encoded batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended inside a field.
    #[error("op-log batch truncated at byte {at}")]
    Truncated {
        /// Offset where more bytes were needed.
        at: usize,
    },
    /// The version byte is not [`VERSION`].
    #[error("op-log batch version {0} (this build reads {VERSION})")]
    Version(u8),
    /// An unknown record tag.
    #[error("op-log record tag {0:#x} unknown")]
    Tag(u8),
    /// A length or count past its bound.
    #[error("op-log {what} = {value} is out of bounds")]
    Bound {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A field with an impossible value (an unknown pin, an endpoint not UTF-8).
    #[error("op-log {what} is invalid")]
    Invalid {
        /// The field.
        what: &'static str,
    },
    /// Bytes after the last record.
    #[error("op-log batch has {0} trailing bytes")]
    Trailing(usize),
}

const T_MOUNT: u8 = 1;
const T_REMOUNT: u8 = 2;
const T_UNMOUNT: u8 = 3;
const T_PUBLISH: u8 = 4;
const T_REMOVE: u8 = 5;

fn pin_byte(p: Pin) -> u8 {
    match p {
        Pin::None => 0,
        Pin::Soft => 1,
        Pin::Hard => 2,
    }
}

impl Record {
    /// Appends this record's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Record::Mount {
                segment,
                endpoint,
                base,
                size,
                rkey,
                owner,
            } => {
                out.push(T_MOUNT);
                out.extend_from_slice(&segment.to_le_bytes());
                out.extend_from_slice(&(endpoint.len() as u16).to_le_bytes());
                out.extend_from_slice(endpoint.as_bytes());
                out.extend_from_slice(&base.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&rkey.to_le_bytes());
                out.extend_from_slice(&owner.to_le_bytes());
            }
            Record::Remount { segment, rkey } => {
                out.push(T_REMOUNT);
                out.extend_from_slice(&segment.to_le_bytes());
                out.extend_from_slice(&rkey.to_le_bytes());
            }
            Record::Unmount { segment } => {
                out.push(T_UNMOUNT);
                out.extend_from_slice(&segment.to_le_bytes());
            }
            Record::Publish {
                key,
                size,
                pin,
                replicas,
            } => {
                out.push(T_PUBLISH);
                put_key(out, key);
                out.extend_from_slice(&size.to_le_bytes());
                out.push(pin_byte(*pin));
                out.push(replicas.len() as u8);
                for (s, off) in replicas {
                    out.extend_from_slice(&s.to_le_bytes());
                    out.extend_from_slice(&off.to_le_bytes());
                }
            }
            Record::Remove { key } => {
                out.push(T_REMOVE);
                put_key(out, key);
            }
        }
    }

    /// Bytes of this record's encoding.
    pub fn encoded_len(&self) -> usize {
        match self {
            Record::Mount { endpoint, .. } => 1 + 8 + 2 + endpoint.len() + 8 + 8 + 4 + 8,
            Record::Remount { .. } => 1 + 8 + 4,
            Record::Unmount { .. } => 1 + 8,
            Record::Publish { key, replicas, .. } => {
                1 + 2 + key.len() + 8 + 2 + 16 * replicas.len()
            }
            Record::Remove { key } => 1 + 2 + key.len(),
        }
    }
}

fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key);
}

/// Encodes records as one batch: the version byte, a count, the records.
pub fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + records.iter().map(Record::encoded_len).sum::<usize>());
    out.push(VERSION);
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    for r in records {
        r.encode(&mut out);
    }
    out
}

/// Encodes records as batches of at most about `max_bytes` each (a record larger than
/// that is a batch of its own), in order.
pub fn encode_chunks(records: &[Record], max_bytes: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 5;
    for (i, r) in records.iter().enumerate() {
        let n = r.encoded_len();
        if i > start && bytes + n > max_bytes {
            out.push(encode(&records[start..i]));
            start = i;
            bytes = 5;
        }
        bytes += n;
    }
    if start < records.len() || out.is_empty() {
        out.push(encode(&records[start..]));
    }
    out
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or(DecodeError::Truncated { at: self.at })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn key(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u16()? as usize;
        if n == 0 || n > MAX_KEY_LEN {
            return Err(DecodeError::Bound {
                what: "key length",
                value: n as u64,
            });
        }
        Ok(self.take(n)?.to_vec())
    }
}

/// Decodes one batch.
pub fn decode(bytes: &[u8]) -> Result<Vec<Record>, DecodeError> {
    let mut r = Reader { b: bytes, at: 0 };
    let v = r.u8()?;
    if v != VERSION {
        return Err(DecodeError::Version(v));
    }
    let count = r.u32()? as usize;
    // Every record takes at least MIN_RECORD bytes: a count the input cannot hold
    // allocates nothing.
    if count > MAX_RECORDS || count > (bytes.len() - r.at) / MIN_RECORD {
        return Err(DecodeError::Bound {
            what: "record count",
            value: count as u64,
        });
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(decode_record(&mut r)?);
    }
    if r.at != bytes.len() {
        return Err(DecodeError::Trailing(bytes.len() - r.at));
    }
    Ok(out)
}

fn decode_record(r: &mut Reader<'_>) -> Result<Record, DecodeError> {
    Ok(match r.u8()? {
        T_MOUNT => {
            let segment = r.u64()?;
            let n = r.u16()? as usize;
            if n > MAX_ENDPOINT {
                return Err(DecodeError::Bound {
                    what: "endpoint length",
                    value: n as u64,
                });
            }
            let endpoint = std::str::from_utf8(r.take(n)?)
                .map_err(|_| DecodeError::Invalid { what: "endpoint" })?
                .to_string();
            let base = r.u64()?;
            let size = r.u64()?;
            if base.checked_add(size).is_none() {
                return Err(DecodeError::Invalid {
                    what: "segment bounds",
                });
            }
            Record::Mount {
                segment,
                endpoint,
                base,
                size,
                rkey: r.u32()?,
                owner: r.u64()?,
            }
        }
        T_REMOUNT => Record::Remount {
            segment: r.u64()?,
            rkey: r.u32()?,
        },
        T_UNMOUNT => Record::Unmount { segment: r.u64()? },
        T_PUBLISH => {
            let key = r.key()?;
            let size = r.u64()?;
            let pin = match r.u8()? {
                0 => Pin::None,
                1 => Pin::Soft,
                2 => Pin::Hard,
                _ => return Err(DecodeError::Invalid { what: "pin" }),
            };
            let n = r.u8()? as usize;
            if n == 0 || n > MAX_REPLICAS {
                return Err(DecodeError::Bound {
                    what: "replica count",
                    value: n as u64,
                });
            }
            let mut replicas = Vec::with_capacity(n);
            for _ in 0..n {
                replicas.push((r.u64()?, r.u64()?));
            }
            Record::Publish {
                key,
                size,
                pin,
                replicas,
            }
        }
        T_REMOVE => Record::Remove { key: r.key()? },
        t => return Err(DecodeError::Tag(t)),
    })
}

/// Why a journal did not commit a request's records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    /// This master is no longer the leader (its epoch lost at the log): it must not
    /// answer.
    #[error("the op-log refused the write: this master is no longer the leader")]
    Deposed,
    /// The log could not be written (unreachable, or the write failed); the leader stands
    /// down, since it cannot know whether its entry landed.
    #[error("the op-log write failed: {0}")]
    Failed(String),
    /// The deadline passed before the entry was committed.
    #[error("the op-log write did not commit within its deadline")]
    Timeout,
}

/// Where a leading master's records go before it answers (an ordered, durable log).
///
/// [`Journal::append`] is called under the master's lock, in the order of the changes,
/// and must not block on I/O; [`Journal::wait`] then blocks the reply until what was
/// appended up to its ticket is committed.
pub trait Journal: Send + Sync + std::fmt::Debug {
    /// Queues `records` (maybe none) after everything appended before; returns the ticket
    /// to wait for (everything appended so far, so that a reply never shows a change that
    /// is not committed yet).
    fn append(&self, records: Vec<Record>) -> u64;
    /// Blocks until everything up to `ticket` is committed, or fails.
    fn wait(&self, ticket: u64, deadline: Instant) -> Result<(), JournalError>;
    /// Whether the log asks for a snapshot now ([`Journal::append_snapshot`]).
    fn snapshot_due(&self) -> bool {
        false
    }
    /// Queues a snapshot of the whole metadata, taken after everything appended before.
    fn append_snapshot(&self, _records: Vec<Record>) {}
}

/// One record of every kind (tests and fuzzing seeds).
#[doc(hidden)]
pub fn sample_records() -> Vec<Record> {
    vec![
        Record::Mount {
            segment: 7,
            endpoint: "127.0.0.1:7000".into(),
            base: 1 << 20,
            size: 64 << 20,
            rkey: 0x42,
            owner: 0x5eed_c1e7,
        },
        Record::Remount {
            segment: 7,
            rkey: 0x43,
        },
        Record::Publish {
            key: b"h0_0_k".to_vec(),
            size: 4096,
            pin: Pin::Soft,
            replicas: vec![(7, 0), (8, 4096)],
        },
        Record::Remove {
            key: b"h0_0_k".to_vec(),
        },
        Record::Unmount { segment: 7 },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Record> {
        sample_records()
    }

    #[test]
    fn batches_round_trip_and_lengths_match() {
        let recs = samples();
        for r in &recs {
            let mut b = Vec::new();
            r.encode(&mut b);
            assert_eq!(b.len(), r.encoded_len(), "{r:?}");
        }
        assert_eq!(decode(&encode(&recs)).unwrap(), recs);
        assert_eq!(decode(&encode(&[])).unwrap(), []);
        let short = vec![Record::Remove { key: b"k".to_vec() }; 3];
        assert_eq!(
            decode(&encode(&short)).unwrap(),
            short,
            "the shortest records"
        );
        let chunks = encode_chunks(&recs, 40);
        assert!(chunks.len() > 1);
        let back: Vec<Record> = chunks.iter().flat_map(|c| decode(c).unwrap()).collect();
        assert_eq!(back, recs);
    }

    #[test]
    fn hostile_batches_are_refused_with_typed_errors() {
        let good = encode(&samples());
        assert_eq!(decode(&[]), Err(DecodeError::Truncated { at: 0 }));
        assert_eq!(decode(&[9, 0, 0, 0, 0]), Err(DecodeError::Version(9)));
        // A batch of version 1 (a `Mount` without its owner) is refused as a whole.
        let mut v1 = good.clone();
        v1[0] = 1;
        assert_eq!(decode(&v1), Err(DecodeError::Version(1)));
        let mut big = vec![VERSION];
        big.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&big), Err(DecodeError::Bound { .. })));
        let mut tag = encode(&[Record::Unmount { segment: 1 }]);
        tag[5] = 0x77;
        assert_eq!(decode(&tag), Err(DecodeError::Tag(0x77)));
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(decode(&trailing), Err(DecodeError::Trailing(1)));
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        // Segments whose sizes add up past u64 apply without overflow (the second is
        // refused).
        let huge = |segment| Record::Mount {
            segment,
            endpoint: "e:1".into(),
            base: 0,
            size: u64::MAX / 2 + 1,
            rkey: 1,
            owner: 9,
        };
        assert!(crate::fuzzing::decode_oplog(&encode(&[huge(1), huge(2)])));
        let mut key0 = encode(&[Record::Remove { key: b"k".to_vec() }]);
        key0[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert!(matches!(decode(&key0), Err(DecodeError::Bound { .. })));
    }

    proptest! {
        #[test]
        fn random_and_mutated_batches_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            at in any::<usize>(), val in any::<u8>(),
        ) {
            let _ = crate::fuzzing::decode_oplog(&bytes);
            let mut g = encode(&samples());
            let i = at % g.len();
            g[i] = val;
            let _ = crate::fuzzing::decode_oplog(&g);
        }
    }
}
