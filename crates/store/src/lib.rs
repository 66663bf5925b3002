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
