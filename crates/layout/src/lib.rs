//! KV-cache pool geometry, SGLang-exact page segments and transfer plans.
//!
//! This crate turns page (or token-slot) indices of a host KV pool into `(ptr, len)` byte
//! segments, exactly as SGLang's `get_page_buffer_meta` does where SGLang answers, and
//! correctly where it refuses; and it builds `(src, dst, len)` transfer plans between two
//! pools, including SGLang's PD Mooncake connector plan. It does no I/O and touches no
//! memory: addresses are plain `u64`s.
//!
//! ```
//! use pagewire_layout::{Layout, Pool, PoolGeometry, PoolKind};
//!
//! # fn main() -> Result<(), pagewire_layout::LayoutError> {
//! // L=2 layers, P=4 tokens per page, H=2 heads of D=3, 2-byte elements, 32 slots.
//! let geometry = PoolGeometry::builder(PoolKind::Mha)
//!     .layers(2)
//!     .page_size(4)
//!     .heads(2)
//!     .head_dim(3)
//!     .dtype_bytes(2)
//!     .capacity(32)
//!     .build()?;
//! let pool = Pool::new(geometry, Layout::PageFirst, 0x1000, None)?;
//!
//! // Two pages (token slots 8..16): per page, its K run then its V run.
//! let indices: Vec<u64> = (8..16).collect();
//! let meta = pool.page_meta(&indices)?;
//! assert_eq!(meta.ptrs, [0x10C0, 0x13C0, 0x1120, 0x1420]);
//! assert_eq!(meta.lens, [96, 96, 96, 96]);
//!
//! // Slots of a page must be consecutive and page-aligned (SGLang does not check).
//! assert!(pool.page_meta(&[9, 10, 11, 12]).is_err());
//! # Ok(())
//! # }
//! ```
//!
//! See `docs/layout.md` in the repository for the byte orders and what goes beyond SGLang.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod geometry;
mod plan;
mod pool;
mod segment;
#[cfg(test)]
mod worked_examples;

pub use error::{LayoutError, MAX_ENTRIES, MAX_PLAN_BLOCKS, MAX_POOL_BYTES, Result};
pub use geometry::{Component, GeometryBuilder, Layout, PoolGeometry, PoolKind};
pub use plan::{
    HeadShards, PageRun, PdBuffers, Transfer, TransferPlan, Transfers, page_runs,
    pd_connector_plan, pd_connector_plan_into, plan, plan_into, plan_layers_into, plan_with_heads,
};
pub use pool::{Checks, ComponentSegments, LayerView, Pool};
pub use segment::{Segment, Segments, coalesce, push_coalesced};
