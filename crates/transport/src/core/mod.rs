//! The part of the transport that does no I/O: no sockets, no threads, no clock reads
//! (time is passed in) and no `unsafe`. It holds the registry of local regions and the
//! table of a peer's exposed ones, validated ops, the batch state machine, prepared-run
//! outcomes, the wait policy as data and the control-plane codec. The engine drives it;
//! backends execute what it decided. `tests/layering.rs` checks that nothing here names
//! `std::net`, `std::thread` or `Instant::now`.
#![forbid(unsafe_code)]

pub(crate) mod batch;
pub(crate) mod handshake;
// WR planning, the QP window and health verdicts serve only the verbs backend.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) mod health;
pub(crate) mod registry;
pub(crate) mod resolve;
pub(crate) mod run;
#[cfg(test)]
mod sim;
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) mod slice;
pub(crate) mod topology;
pub(crate) mod wait;
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) mod window;
pub(crate) mod wire;
