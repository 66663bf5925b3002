//! A distributed KV page store on pagewire, in the manner of Mooncake Store: storage nodes
//! pool their memory, a master keeps `key -> replicas` and decides where bytes go, and
//! clients move the bytes themselves, zero-copy, with one pagewire batch per storage node.
//!
//! * [`Master`]: membership, object metadata, allocation over mounted segments, read
//!   leases, eviction, reclaiming unfinished puts. Never on the data path. Its decisions
//!   live in [`core::MasterCore`], which does no I/O.
//! * A storage node is a [`StoreClient`] that contributes a segment
//!   ([`ClientConfig::segment_size`]); it allocates and registers it once.
//! * [`StoreClient`]: `put` (reserve, write every replica, publish), `get` (lease, read),
//!   `exist`, `remove`, all batched: many keys per round trip to the master.
//! * The control protocol ([`proto`]) is versioned, size-capped and decoded as hostile.
//!
//! ```
//! use pagewire_store::{ClientConfig, Master, MasterConfig, PutOptions, Span, StoreClient};
//! use pagewire_transport::{BackendKind, EngineConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let master = Master::start(MasterConfig {
//!     listen: "127.0.0.1:0".parse()?,
//!     ..MasterConfig::default()
//! })?;
//! let cfg = |segment| -> Result<ClientConfig, pagewire_transport::Error> {
//!     let mut c = ClientConfig::new(master.local_addr().to_string());
//!     c.engine = EngineConfig::builder()
//!         .backend(BackendKind::Loopback)
//!         .listen("127.0.0.1:0".parse().unwrap())
//!         .build()?;
//!     c.segment_size = segment;
//!     Ok(c)
//! };
//! let node = StoreClient::connect(cfg(16 << 20)?)?; // offers 16 MiB
//! let client = StoreClient::connect(cfg(0)?)?;
//!
//! // Pages live in memory registered with the client (a host KV pool, say).
//! let mut pool = vec![0u8; 2 * 4096];
//! pool[..4].copy_from_slice(b"page");
//! // SAFETY: `pool` outlives the client (it is closed below) and is not reallocated.
//! unsafe { client.register_buffer(pool.as_mut_ptr(), pool.len())? };
//! let base = pool.as_ptr() as u64;
//!
//! let put = client.put(&["h0_0_k"], &[[Span::new(base, 4096)]], &PutOptions::default())?;
//! assert_eq!(put, [Ok(())]);
//! let got = client.get(&["h0_0_k"], &[[Span::new(base + 4096, 4096)]])?;
//! assert_eq!(got, [Ok(4096)]);
//! client.close();
//! assert_eq!(&pool[4096..4100], b"page");
//! # node.close();
//! # Ok(()) }
//! ```
//!
//! `docs/store.md` describes the roles, the protocol, what readers can observe when
//! things fail, the configuration, and how the design scales past one master.
#![warn(missing_docs)]

mod admission;
pub mod alloc;
pub mod client;
pub mod core;
pub mod error;
pub mod ipc;
mod local;
pub mod master;
mod net;
pub mod oplog;
pub mod proto;
mod rpc;
pub mod shard;
mod shm;
pub mod standalone;

pub use client::{ClientConfig, Located, PutOptions, Reservation, StoreClient, Target};
pub use error::{Code, Result, StoreError};
pub use local::Span;
pub use master::{Authority, Master, MasterConfig};
pub use oplog::{Journal, JournalError, Record};
pub use proto::{Pin, Stats};
pub use rpc::MasterLocator;
pub use standalone::{DummyClient, DummyConfig, IpcAddr, RealClient, RealClientConfig, SharedBuf};

/// Internals exposed for the `cargo fuzz` target and the corpus test; not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    use crate::proto;

    /// Decodes an op-log batch; whether it decoded. Must never panic. A batch that
    /// decodes also encodes back to the same bytes, and applies to a fresh core.
    pub fn decode_oplog(bytes: &[u8]) -> bool {
        match crate::oplog::decode(bytes) {
            Ok(recs) => {
                assert_eq!(crate::oplog::encode(&recs), bytes, "re-encoding differs");
                let mut core = crate::core::MasterCore::new(Default::default(), 1);
                core.apply(0, &recs);
                true
            }
            Err(_) => false,
        }
    }

    /// Decodes one whole frame (header + body) as a request and as a response, with the
    /// default cap; returns whether either decoded. Must never panic.
    pub fn decode_frame(bytes: &[u8]) -> bool {
        match proto::split_frame(bytes, proto::DEFAULT_MAX_FRAME) {
            Ok((h, body)) => {
                proto::decode_request(h.kind, body).is_ok()
                    | proto::decode_response(h.kind, body).is_ok()
            }
            Err(_) => false,
        }
    }

    /// One valid frame of every kind (fuzzing seeds).
    pub fn sample_frames() -> Vec<Vec<u8>> {
        use proto::*;
        let segs = vec![SegmentRef {
            id: 3,
            endpoint: "127.0.0.1:7000".into(),
            base: 1 << 20,
            rkey: 0x42,
        }];
        let reqs = [
            Request::Hello(Hello {
                token: b"t".to_vec(),
                client_id: 0,
                endpoint: "127.0.0.1:7000".into(),
            }),
            Request::Heartbeat,
            Request::Mount {
                base: 1 << 20,
                size: 1 << 20,
                rkey: 0x42,
            },
            Request::Unmount { segment: 3 },
            Request::PutStart(PutStart {
                replicas: 2,
                pin: Pin::Soft,
                preferred: String::new(),
                items: vec![(b"h_0_k".to_vec(), 4096)],
            }),
            Request::PutFinish(PutFinish {
                done: vec![b"a".to_vec()],
                revoked: vec![b"b".to_vec()],
                suspects: vec![3],
            }),
            Request::Get {
                lease: true,
                keys: vec![b"a".to_vec()],
            },
            Request::Exist {
                keys: vec![b"a".to_vec()],
            },
            Request::Remove {
                force: false,
                keys: vec![b"a".to_vec()],
            },
            Request::RemoveAll { force: true },
            Request::RemoveMatching {
                force: false,
                pattern: "^a".into(),
            },
            Request::Stats,
            Request::Report { suspects: vec![3] },
            Request::Bye,
        ];
        let resps = [
            Response::Welcome(Welcome {
                client_id: 9,
                epoch: 1,
                resumed: true,
                lease_ttl_ms: 10_000,
                heartbeat_ms: 1000,
                client_ttl_ms: 10_000,
                max_frame: DEFAULT_MAX_FRAME,
                put_discard_ms: 30_000,
            }),
            Response::Ack,
            Response::Mounted { segment: 3 },
            Response::Placed(Placement {
                segments: segs.clone(),
                items: vec![
                    Ok(vec![Replica {
                        segment: 3,
                        addr: 64,
                    }]),
                    Err(crate::Code::NoSpace),
                ],
            }),
            Response::Codes(vec![crate::Code::Ok, crate::Code::HasLease]),
            Response::Found(Found {
                lease_ttl_ms: 10_000,
                segments: segs,
                items: vec![Ok(ObjectInfo {
                    size: 4096,
                    replicas: vec![Replica {
                        segment: 3,
                        addr: 64,
                    }],
                })],
            }),
            Response::Count(2),
            Response::Stats(Stats::default()),
            Response::Error {
                code: crate::Code::Unauthorized,
                message: "no".into(),
            },
        ];
        let mut out = Vec::new();
        for r in &reqs {
            let mut b = Vec::new();
            r.encode(1, &mut b);
            out.push(b);
        }
        for r in &resps {
            let mut b = Vec::new();
            r.encode(1, &mut b);
            out.push(b);
        }
        out
    }

    /// Decodes one whole frame of the dummy-client protocol ([`crate::ipc`]) as a request
    /// and as a response; returns whether either decoded. Must never panic.
    pub fn decode_ipc_frame(bytes: &[u8]) -> bool {
        match crate::ipc::split_frame(bytes, crate::ipc::MAX_FRAME) {
            Ok((h, body)) => {
                crate::ipc::decode_request(h.kind, body).is_ok()
                    | crate::ipc::decode_response(h.kind, body).is_ok()
            }
            Err(_) => false,
        }
    }

    /// Decodes `bytes` as the body of every dummy-protocol frame kind. Must never panic.
    pub fn decode_ipc_bodies(bytes: &[u8]) {
        for kind in (1..=11).chain([0x81, 0x82, 0x8f]) {
            let _ = crate::ipc::decode_request(kind, bytes);
            let _ = crate::ipc::decode_response(kind, bytes);
        }
    }

    /// Decodes `bytes` as the body of every frame kind, both directions. Must never panic.
    pub fn decode_bodies(bytes: &[u8]) {
        for kind in (1..=14).chain(0x81..=0x88).chain([0x8f]) {
            let _ = proto::decode_request(kind, bytes);
            let _ = proto::decode_response(kind, bytes);
        }
    }
}
