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
    /// A geometry whose buffers together would be larger than [`MAX_POOL_BYTES`]: no address
    /// space holds them, so the geometry is refused before anything is computed from it.
    #[error(
        "pool too large: {what} = {} bytes, more than the limit of {limit} bytes (2^57)",
        Big(*.value)
    )]
    TooLarge {
        /// The product, spelled with the field names (`layers x capacity x ...`).
        what: &'static str,
        /// Its value (`u128::MAX` when it does not fit in 128 bits either).
        value: u128,
        /// [`MAX_POOL_BYTES`].
        limit: u64,
    },
    /// A request whose result would have more than [`MAX_ENTRIES`] entries (or a plan whose
    /// construction would visit more than [`MAX_PLAN_BLOCKS`] blocks): refused before any
    /// list is reserved or grown. Split the request.
    #[error("{what}: {} {unit}, more than the limit of {limit}; split the request", Big(*.count))]
    TooManyEntries {
        /// The request, with how its size is counted (`page_meta: pages x layers x 2`).
        what: &'static str,
        /// The count (`u128::MAX` when it does not fit in 128 bits either).
        count: u128,
        /// `entries` or `blocks`.
        unit: &'static str,
        /// The bound it exceeds.
        limit: u64,
    },
    /// A head shard that does not fit the global head count, or shards that share no head.
    #[error("bad head shard: {reason}")]
    HeadShard {
        /// What is wrong.
        reason: &'static str,
    },
}

/// The most bytes the buffers of one pool may span together: 2^57, the virtual address
/// space of x86-64 with 5-level paging (and more than any other 64-bit MMU maps today). A
/// geometry beyond it cannot be backed by memory, and below it every byte offset inside
/// the pool, and `base + offset` for any base that leaves the buffer's end below 2^64, is
/// computed without overflow.
pub const MAX_POOL_BYTES: u64 = 1 << 57;

/// The most entries one segment list or transfer plan may have: 2^28 (268,435,456), i.e.
/// 4 GiB of `u64` pairs in a [`crate::Segments`], 6 GiB in a [`crate::TransferPlan`]. The
/// exact entry count of a `page_meta` request (pages x entries per page) is checked against
/// it before anything is reserved. For scale: 100,000 pages of a 64-layer `layer_first` MHA
/// pool are 12.8 M entries (2^23.6).
pub const MAX_ENTRIES: usize = 1 << 28;

/// The most blocks a plan may visit before merging: 2^32, a few seconds of work. Plans
/// merge contiguous blocks, so their length is not known up front; the blocks before merging
/// are, and are checked against this bound first, while the merged plan is held to
/// [`MAX_ENTRIES`] as it grows.
pub const MAX_PLAN_BLOCKS: u64 = 1 << 32;

/// A `u128` that may stand for "at least 2^128" (`u128::MAX`), for error messages.
struct Big(u128);

impl std::fmt::Display for Big {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == u128::MAX {
            f.write_str("at least 2^128")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// The product of `factors` in `u128`, `u128::MAX` when it overflows even that.
pub(crate) fn product(factors: &[u64]) -> u128 {
    factors
        .iter()
        .try_fold(1u128, |acc, &f| acc.checked_mul(u128::from(f)))
        .unwrap_or(u128::MAX)
}

/// `count` if it is at most `limit`, else [`LayoutError::TooManyEntries`].
pub(crate) fn bounded(
    what: &'static str,
    unit: &'static str,
    count: u128,
    limit: u64,
) -> Result<u64> {
    if count <= u128::from(limit) {
        Ok(count as u64)
    } else {
        Err(LayoutError::TooManyEntries {
            what,
            count,
            unit,
            limit,
        })
    }
}

/// The entry count of a list request, checked against [`MAX_ENTRIES`].
pub(crate) fn entries(what: &'static str, factors: &[u64]) -> Result<usize> {
    bounded(what, "entries", product(factors), MAX_ENTRIES as u64).map(|n| n as usize)
}

/// The block count of a plan before merging, checked against [`MAX_PLAN_BLOCKS`].
pub(crate) fn plan_blocks(what: &'static str, factors: &[u64]) -> Result<u64> {
    bounded(what, "blocks", product(factors), MAX_PLAN_BLOCKS)
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
