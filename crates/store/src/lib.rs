//! A distributed KV page store on pagewire (Mooncake-Store-style).
#![warn(missing_docs)]

pub mod alloc;
pub mod core;
pub mod error;
pub mod proto;

pub use error::{Code, Result, StoreError};
