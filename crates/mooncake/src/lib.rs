//! Mooncake Transfer Engine semantics over pagewire: segments, registrations, batches,
//! status and named notifications.
//!
//! [`TransferEngine`] is Mooncake's engine in Rust, in Mooncake's terms, on one
//! pagewire transport engine: segments named `host:port` (the peer engine's handshake
//! listener, Mooncake's P2P mode), opened once and cached by name; buffers registered
//! by their start address with Mooncake's overlap rules; batch ids with per-task status;
//! notifications of two strings delivered after the data. Failures carry Mooncake's
//! codes as a type ([`Code`]); the C ABI (`crates/capi`, `transfer_engine_c.h`) and the
//! Python package (`pagewire.mooncake_compat`) are thin layers that spell them in their
//! own conventions. Where Mooncake is lax this is strict: every range of a call is
//! checked before anything is posted, raw addresses are checked to be memory of this
//! process, unknown or freed ids are errors, every wait has a deadline.
//!
//! Peers are pagewire engines (API-compatible with Mooncake, not wire-compatible).
//!
//! ```
//! use pagewire_mooncake::{Opcode, Options, Request, Transfer, TransferEngine, TransferStatus};
//!
//! # fn main() -> Result<(), pagewire_mooncake::Error> {
//! let opts = Options { protocol: Some("tcp".into()), ..Options::default() };
//! let prefill = TransferEngine::new("P2PHANDSHAKE", "127.0.0.1", opts.clone())?;
//! let decode = TransferEngine::new("P2PHANDSHAKE", "127.0.0.1", opts)?;
//!
//! let page = b"KV page 0".to_vec();
//! let mut pool = vec![0u8; 1 << 16];
//! let (src, dst) = (page.as_ptr() as u64, pool.as_mut_ptr() as u64);
//! // SAFETY: both buffers outlive their registrations (the engines close first).
//! unsafe {
//!     prefill.register(src, page.len() as u64, false)?;
//!     decode.register(dst, pool.len() as u64, true)?; // peers may write it
//! }
//!
//! // The Python binding's call: by session id, synchronous, with a notification.
//! let (srcs, dsts, lens) = ([src], [dst + 64], [9]);
//! let page_to_pool = Transfer::write(decode.name(), &srcs, &dsts, &lens);
//! prefill.transfer_sync(&page_to_pool, Some((b"prefill-0", b"req-42")))?;
//!
//! // The C API's calls: a segment id, a batch id, a task's status.
//! let seg = prefill.open_segment(decode.name(), false)?;
//! let batch = prefill.allocate_batch(4)?;
//! let req = Request { opcode: Opcode::Write, source: src, target_id: seg,
//!                     target_offset: dst + 4096, length: 9 };
//! prefill.submit(batch, &[req], None)?;
//! while prefill.task_status(batch, 0)?.status == TransferStatus::Waiting {
//!     std::thread::yield_now();
//! }
//! assert_eq!(prefill.task_status(batch, 0)?.status, TransferStatus::Completed);
//! prefill.free_batch(batch)?;
//! assert!(prefill.free_batch(batch).is_err()); // a freed id is dead
//!
//! // The notification arrived after its data.
//! let notes = loop {
//!     let n = decode.take_notifications();
//!     if !n.is_empty() { break n; }
//!     std::thread::yield_now();
//! };
//! assert_eq!(notes, vec![(b"prefill-0".to_vec(), b"req-42".to_vec())]);
//!
//! // Mooncake's codes for bad input; nothing is sent.
//! let stray = [64]; // not the peer's registered memory
//! let err = prefill.transfer_sync(&Transfer::write(decode.name(), &srcs, &stray, &lens), None);
//! let err = err.unwrap_err();
//! assert_eq!(err.code(), pagewire_mooncake::Code::AddressNotRegistered);
//!
//! prefill.close();
//! decode.close(); // no engine touches `pool` any more
//! assert_eq!(&pool[64..73], b"KV page 0");
//! assert_eq!(&pool[4096..4105], b"KV page 0");
//! # Ok(()) }
//! ```
//!
//! Segment names are P2P handshake names by default; with a metadata directory
//! ([`directory`], etcd through `pagewire-ha`) an engine publishes the name it was given
//! and peers look it up there.
//!
//! Environment: `MC_TRANSFER_TIMEOUT`, `MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT`,
//! `MC_FORCE_TCP` as Mooncake reads them ([`env`]), and the transport's `PAGEWIRE_*`.

mod code;
pub mod directory;
mod engine;
pub mod env;
mod mailbox;
mod managed;
pub mod memcheck;
mod segments;
pub mod sid;
mod transfer;

pub use code::{Code, Error};
pub use directory::{DirectoryError, MetadataDirectory, SegmentDescriptor};
pub use engine::{DEFAULT_HANDSHAKE_TIMEOUT, Note, Options, TransferEngine};
pub use mailbox::{MAX_NOTIFY_BYTES, OUTBOX_BYTES, QUEUE_MAX, SLOT_BYTES, SLOTS};
pub use managed::MANAGED_CHUNK_BYTES;
pub use segments::{LOCAL_SEGMENT, SegmentInfo};
pub use transfer::{
    BatchCheck, MAX_BATCH_SIZE, Opcode, Request, TaskStatus, Transfer, TransferStatus,
};

/// Locks a mutex, also when a panicking thread poisoned it (the state stays consistent:
/// no critical section here leaves it half-updated).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A random number (port picks, batch id tags), from the standard library's randomly
/// keyed hasher.
pub(crate) fn random_u64(salt: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
