//! The control-plane handshake as states that consume frames: what each side expects next,
//! and what a frame it receives means. No socket here: the engine reads a frame, hands it
//! to the state it is in, and writes what the answer says.
//!
//! Initiator: sends `Hello`, then [`AwaitWelcome`] -> (its connection completes and proves
//! the path, it sends `Ready`) -> [`AwaitReady`] (the acceptor published it) -> connected.
//! Acceptor: [`AwaitRequest`] takes the first frame (`Hello` or `Describe`), after which it
//! checks the backend ([`check_backend`]), completes, sends `Welcome` and then expects
//! `Ready` ([`AwaitReady`]). `redescribe` sends `Describe` and is in [`AwaitRegions`].
//! A rail's reconnection: the initiator sends `Rail` with its new QPs and is in
//! [`AwaitRailAccepted`]; once its QPs carried a probe it sends `Ready`, which the acceptor
//! awaits before its side uses the rail again.

use std::ops::RangeInclusive;

use crate::core::wire::{EndpointInfo, Frame, Hello, Welcome};
use crate::error::HandshakeError;
use crate::types::RemoteRegion;
use crate::util::ct_eq;

/// The `Reject` reason of an acceptor at its `max_peers`: fixed text, so the initiator
/// reports it as [`HandshakeError::TooManyPeers`].
pub(crate) const TOO_MANY_PEERS: &str = "too many peers";

/// The `Reject` reason for a token that differs from the acceptor's (none counts as
/// one): fixed text, so the initiator reports it as [`HandshakeError::TokenMismatch`].
pub(crate) const TOKEN_MISMATCH: &str = "token mismatch";

/// A frame of a kind the state does not expect, or the peer's refusal.
fn unexpected(f: Frame, expected: &'static str) -> HandshakeError {
    match f {
        Frame::Reject { reason } if reason == TOO_MANY_PEERS => HandshakeError::TooManyPeers,
        Frame::Reject { reason } if reason == TOKEN_MISMATCH => HandshakeError::TokenMismatch,
        Frame::Reject { reason } => HandshakeError::Rejected { reason },
        other => HandshakeError::UnexpectedFrame {
            expected,
            found: other.kind(),
        },
    }
}

/// The initiator sent its `Hello` and waits for the acceptor's `Welcome`.
#[derive(Debug)]
pub(crate) struct AwaitWelcome<'a> {
    /// Our endpoint (its backend must match theirs).
    pub ours: &'a EndpointInfo,
}

impl AwaitWelcome<'_> {
    /// The acceptor's answer: its `Welcome` (same backend as ours), or why not.
    pub(crate) fn handle(self, f: Frame) -> Result<(Welcome, AwaitReady), HandshakeError> {
        match f {
            Frame::Welcome(w) => {
                check_backend(&w.endpoint, self.ours)?;
                Ok((w, AwaitReady))
            }
            other => Err(unexpected(other, "Welcome")),
        }
    }
}

/// Either side waits for the other's `Ready`.
#[derive(Debug)]
pub(crate) struct AwaitReady;

impl AwaitReady {
    pub(crate) fn handle(self, f: Frame) -> Result<(), HandshakeError> {
        match f {
            Frame::Ready => Ok(()),
            other => Err(unexpected(other, "Ready")),
        }
    }
}

/// `redescribe` sent `Describe` and waits for the peer's regions.
#[derive(Debug)]
pub(crate) struct AwaitRegions;

impl AwaitRegions {
    pub(crate) fn handle(self, f: Frame) -> Result<Vec<RemoteRegion>, HandshakeError> {
        match f {
            Frame::Regions(r) => Ok(r),
            other => Err(unexpected(other, "Regions")),
        }
    }
}

/// The initiator sent `Rail` and waits for the acceptor's new QPs for that rail.
#[derive(Debug)]
pub(crate) struct AwaitRailAccepted;

impl AwaitRailAccepted {
    pub(crate) fn handle(self, f: Frame) -> Result<EndpointInfo, HandshakeError> {
        match f {
            Frame::RailAccepted(e) => Ok(e),
            other => Err(unexpected(other, "RailAccepted")),
        }
    }
}

/// What an acceptor was asked, once the first frame checked out.
#[derive(Debug)]
pub(crate) enum Request {
    /// A new connection.
    Hello(Hello),
    /// The current regions of the connection this side knows as `session`.
    Describe { session: u64 },
    /// New QPs for rail `rail` of the connection this side knows as `session`.
    Rail {
        session: u64,
        rail: u8,
        endpoint: EndpointInfo,
    },
}

/// A refused request: the error for our log, and the fixed text the peer is told (what
/// failed inside stays here, not in a stranger's hands).
#[derive(Debug)]
pub(crate) struct Refused {
    pub error: HandshakeError,
    pub tell: Option<&'static str>,
}

/// The acceptor waits for the first frame of a control connection.
#[derive(Debug)]
pub(crate) struct AwaitRequest<'a> {
    /// The shared token (empty: none).
    pub token: &'a [u8],
    /// Without a token nothing vouches for the client, so a TCP `Hello` may only name a
    /// data port its listener could have been given (the ephemeral range, asked for only
    /// when a TCP `Hello` arrives); `None` when a token is set.
    pub tokenless_ports: Option<fn() -> RangeInclusive<u16>>,
}

impl AwaitRequest<'_> {
    pub(crate) fn handle(self, f: Frame) -> Result<Request, Refused> {
        let (token, req) = match f {
            Frame::Hello(h) => (h.token.clone(), Request::Hello(h)),
            Frame::Describe { token, session } => (token, Request::Describe { session }),
            Frame::Rail {
                token,
                session,
                rail,
                endpoint,
            } => (
                token,
                Request::Rail {
                    session,
                    rail,
                    endpoint,
                },
            ),
            other => {
                return Err(Refused {
                    error: HandshakeError::UnexpectedFrame {
                        expected: "Hello, Describe or Rail",
                        found: other.kind(),
                    },
                    tell: None,
                });
            }
        };
        if !ct_eq(&token, self.token) {
            return Err(Refused {
                error: HandshakeError::TokenMismatch,
                tell: Some(TOKEN_MISMATCH),
            });
        }
        if let Request::Hello(h) = &req
            && let EndpointInfo::Tcp { data_port, .. } = h.endpoint
            && let Some(r) = self.tokenless_ports.map(|ports| ports())
            && !r.contains(&data_port)
        {
            return Err(Refused {
                error: HandshakeError::BadField {
                    field: "data port",
                    value: format!("{data_port} (ephemeral range {}-{})", r.start(), r.end()),
                },
                tell: Some("data port outside the ephemeral port range"),
            });
        }
        Ok(req)
    }
}

/// Both ends must run the same backend.
pub(crate) fn check_backend(
    theirs: &EndpointInfo,
    ours: &EndpointInfo,
) -> Result<(), HandshakeError> {
    if theirs.backend_name() == ours.backend_name() {
        Ok(())
    } else {
        Err(HandshakeError::BackendMismatch {
            ours: ours.backend_name().into(),
            theirs: theirs.backend_name().into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(port: u16) -> EndpointInfo {
        EndpointInfo::Tcp {
            data_port: port,
            streams: 1,
            session: 1,
        }
    }

    fn hello(token: &[u8], ep: EndpointInfo) -> Frame {
        Frame::Hello(Hello {
            token: token.to_vec(),
            engine_id: 1,
            listen_port: 1,
            session: 2,
            endpoint: ep,
            regions: Vec::new(),
        })
    }

    #[test]
    fn the_initiator_accepts_only_a_matching_welcome() {
        let ours = tcp(40000);
        let welcome = |ep| {
            Frame::Welcome(Welcome {
                engine_id: 2,
                session: 3,
                endpoint: ep,
                regions: Vec::new(),
            })
        };
        let (w, next) = AwaitWelcome { ours: &ours }
            .handle(welcome(tcp(40001)))
            .unwrap();
        assert_eq!(w.session, 3);
        assert!(next.handle(Frame::Ready).is_ok());
        let lo = EndpointInfo::Loopback {
            engine_id: 1,
            conn: 1,
        };
        assert!(matches!(
            AwaitWelcome { ours: &ours }.handle(welcome(lo)),
            Err(HandshakeError::BackendMismatch { .. })
        ));
        assert!(matches!(
            AwaitWelcome { ours: &ours }.handle(Frame::Reject {
                reason: "busy".into()
            }),
            Err(HandshakeError::Rejected { .. })
        ));
        // A full acceptor's refusal is typed, before (Welcome) or after (Ready) it set up.
        assert_eq!(
            AwaitReady
                .handle(Frame::Reject {
                    reason: TOO_MANY_PEERS.into()
                })
                .unwrap_err(),
            HandshakeError::TooManyPeers
        );
        // So is a refused token.
        assert_eq!(
            AwaitWelcome { ours: &ours }
                .handle(Frame::Reject {
                    reason: TOKEN_MISMATCH.into()
                })
                .unwrap_err(),
            HandshakeError::TokenMismatch
        );
        assert!(matches!(
            AwaitReady.handle(Frame::Regions(Vec::new())),
            Err(HandshakeError::UnexpectedFrame {
                expected: "Ready",
                ..
            })
        ));
    }

    #[test]
    fn the_acceptor_checks_the_token_and_a_tokenless_data_port() {
        let ok = AwaitRequest {
            token: b"secret",
            tokenless_ports: None,
        };
        assert!(matches!(
            ok.handle(hello(b"secret", tcp(22))),
            Ok(Request::Hello(_))
        ));
        let r = AwaitRequest {
            token: b"secret",
            tokenless_ports: None,
        }
        .handle(hello(b"guess", tcp(40000)))
        .unwrap_err();
        assert_eq!(r.error, HandshakeError::TokenMismatch);
        assert_eq!(r.tell, Some("token mismatch"));
        let open = || AwaitRequest {
            token: b"",
            tokenless_ports: Some(|| 32768..=60999),
        };
        assert!(open().handle(hello(b"", tcp(40000))).is_ok());
        let r = open().handle(hello(b"", tcp(22))).unwrap_err();
        assert!(matches!(
            r.error,
            HandshakeError::BadField {
                field: "data port",
                ..
            }
        ));
        assert!(matches!(
            open().handle(Frame::Describe {
                token: Vec::new(),
                session: 9
            }),
            Ok(Request::Describe { session: 9 })
        ));
        let r = open().handle(Frame::Ready).unwrap_err();
        assert!(r.tell.is_none());
    }
}
