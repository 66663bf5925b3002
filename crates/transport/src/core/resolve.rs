//! Ops after validation: each piece lies inside one local registration and one region the
//! peer exposed, with both keys resolved. What the engine hands a backend to execute.

use crate::types::Op;

/// A batch's resolved ops; up to two inline, so a small batch allocates no list.
pub(crate) type ResolvedOps = smallvec::SmallVec<[ResolvedOp; 2]>;

/// One validated, key-resolved piece of a batch. The local range is inside one local MR
/// chunk, the remote range inside one chunk the peer exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResolvedOp {
    pub op: Op,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
}
