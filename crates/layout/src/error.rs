//! The one error type of the crate.

use crate::{Layout, PoolKind};

/// Everything that can be wrong with a geometry, an index list or a plan request.
///
/// Every variant names the offending value, so a caller can print it as is.
#[non_exhaustive]
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
pub enum LayoutError {
    /// A geometry field is out of its domain (zero, or otherwise unusable).
    #[error("invalid {field} = {value}: {reason}")]
    InvalidGeometry {
        /// The field name as the CLI spells it (`layers`, `page_size`, ...).
        field: &'static str,
        /// The rejected value.
        value: u64,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A geometry field the pool kind needs was not given.
    #[error("{field} is required for a {kind} pool")]
    MissingField {
        /// The missing field.
        field: &'static str,
        /// The pool kind.
        kind: PoolKind,
    },
    /// A geometry field was given that the pool kind does not have.
    #[error("{field} = {value} does not apply to a {kind} pool")]
    ExtraField {
        /// The superfluous field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The pool kind.
        kind: PoolKind,
    },
    /// A pool kind name that is not `mha`, `mha-split` or `mla`.
    #[error("unknown pool kind {0:?} (expected mha, mha-split or mla)")]
    UnknownPoolKind(String),
    /// A layout name that is not one of SGLang's four.
    #[error(
        "unknown layout {0:?} (expected layer_first, page_first, page_first_direct or page_head)"
    )]
    UnknownLayout(String),
    /// The pool kind cannot be laid out this way (MLA has no head axis, so no `page_head`).
    #[error("layout {layout} is not possible for a {kind} pool")]
    UnsupportedLayout {
        /// The pool kind.
        kind: PoolKind,
        /// The rejected layout.
        layout: Layout,
    },
    /// Split heads need the head axis outermost inside a page, i.e. `page_head`.
    #[error("split heads need the page_head layout, not {layout} ({kind} pool)")]
    SplitHeadsLayout {
        /// The pool kind.
        kind: PoolKind,
        /// The pool's layout.
        layout: Layout,
    },
    /// The split factor is zero or does not divide the head count.
    #[error("split factor {factor} does not divide the {heads} heads")]
    SplitFactor {
        /// The rejected split factor.
        factor: u64,
        /// The pool's head count.
        heads: u64,
    },
    /// A base address is missing, superfluous or makes the buffers overlap.
    #[error("bad base address: {reason}")]
    Base {
        /// What is wrong.
        reason: &'static str,
    },
    /// The number of token indices is not a whole number of pages.
    #[error("index count {count} is not a multiple of the page size {page_size}")]
    IndexCount {
        /// Number of token indices given.
        count: usize,
        /// The pool's page size.
        page_size: u64,
    },
    /// A page's first slot is not a multiple of the page size.
    #[error(
        "page #{position} starts at slot {slot}, which is not a multiple of the page size {page_size}"
    )]
    Misaligned {
        /// Position of the page in the request (0-based).
        position: usize,
        /// Its first token slot.
        slot: u64,
        /// The pool's page size.
        page_size: u64,
    },
    /// A page's slots are not `t0, t0+1, ..., t0+P-1`.
    #[error(
        "page #{position}: slot {found} at offset {offset} should be {expected} (slots of a page must be consecutive)"
    )]
    NonConsecutive {
        /// Position of the page in the request (0-based).
        position: usize,
        /// Offset inside the page.
        offset: u64,
        /// The slot found there.
        found: u64,
        /// The slot that should be there.
        expected: u64,
    },
    /// A token slot (or the end of its page) lies beyond the pool's capacity.
    #[error("token slot {slot} is beyond the capacity of {capacity} slots")]
    SlotOutOfRange {
        /// The offending slot.
        slot: u64,
        /// The pool's capacity in tokens.
        capacity: u64,
    },
    /// A page index lies beyond the pool's page count.
    #[error("page {page} is beyond the pool's {pages} pages")]
    PageOutOfRange {
        /// The offending page index.
        page: u64,
        /// The number of pages of the pool.
        pages: u64,
    },
    /// A destination page appears twice in a plan: two sources would race for it.
    #[error("destination page {page} appears more than once")]
    DuplicatePage {
        /// The repeated page.
        page: u64,
    },
    /// A layer, head or element index lies beyond its axis.
    #[error("{axis} {index} is out of range (the pool has {size})")]
    IndexOutOfRange {
        /// `layer`, `head` or `dim`.
        axis: &'static str,
        /// The offending index.
        index: u64,
        /// The axis length.
        size: u64,
    },
    /// A computation would not fit in 64 bits.
    #[error("arithmetic overflow computing {what}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// Two lists that must have the same length do not.
    #[error("{what}: {left} vs {right} entries")]
    LengthMismatch {
        /// Which lists.
        what: &'static str,
        /// Length of the first list.
        left: usize,
        /// Length of the second list.
        right: usize,
    },
    /// Source and destination pools disagree on something a plan needs to be equal.
    #[error("source and destination differ in {what}: {src} vs {dst}")]
    GeometryMismatch {
        /// The field.
        what: &'static str,
        /// Source value.
        src: u64,
        /// Destination value.
        dst: u64,
    },
    /// Source and destination pools have incompatible kinds (MLA against MHA).
    #[error("cannot plan a transfer from a {src} pool to a {dst} pool")]
    KindMismatch {
        /// Source kind.
        src: PoolKind,
        /// Destination kind.
        dst: PoolKind,
    },
    /// A head shard that does not fit the global head count, or shards that share no head.
    #[error("bad head shard: {reason}")]
    HeadShard {
        /// What is wrong.
        reason: &'static str,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = LayoutError> = std::result::Result<T, E>;

/// `a * b`, or [`LayoutError::Overflow`] naming `what`.
pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

/// `a + b`, or [`LayoutError::Overflow`] naming `what`.
pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_add(b).ok_or(LayoutError::Overflow { what })
}
