//! A distributed KV page store on pagewire (Mooncake-Store-style).
#![warn(missing_docs)]

pub mod alloc;
pub mod client;
pub mod core;
pub mod error;
mod local;
pub mod master;
mod net;
pub mod proto;
mod rpc;

pub use client::{ClientConfig, Located, PutOptions, Reservation, StoreClient, Target};
pub use error::{Code, Result, StoreError};
pub use local::Span;
pub use master::{Master, MasterConfig};
pub use proto::{Pin, Stats};

/// Internals exposed for the `cargo fuzz` target and the corpus test; not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    use crate::proto;

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
                remount: false,
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

    /// Decodes `bytes` as the body of every frame kind, both directions. Must never panic.
    pub fn decode_bodies(bytes: &[u8]) {
        for kind in (1..=13).chain(0x81..=0x88).chain([0x8f]) {
            let _ = proto::decode_request(kind, bytes);
            let _ = proto::decode_response(kind, bytes);
        }
    }
}
