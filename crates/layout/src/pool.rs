//! A pool = geometry + layout + base addresses; page segment lists.

use crate::error::{LayoutError, MAX_ENTRIES, Result, add, entries};
use crate::geometry::{Component, Layout, PoolGeometry, PoolKind};
use crate::segment::{Segment, Segments, push_coalesced};

/// How much of SGLang's unchecked index contract is verified.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub enum Checks {
    /// Every slot of every page is checked: a page's slots are `t0..t0+P`, `t0` is a
    /// multiple of `P` and the page lies inside the pool. The default.
    #[default]
    Strict,
    /// Only what SGLang itself looks at: the index count, and the first slot of each page
    /// (`indices[0], indices[P], ...`), which must leave the page inside the pool. Other
    /// slots are not read, and for the layouts SGLang supports a misaligned first slot gives
    /// SGLang's (meaningless but in-bounds) pointer. Layouts SGLang refuses still require
    /// alignment, since there is no SGLang answer to reproduce.
    Sglang,
}

/// A host KV pool: its [`PoolGeometry`], its [`Layout`] and the base address of each buffer.
///
/// Addresses are plain integers; nothing here dereferences them.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Pool {
    geometry: PoolGeometry,
    layout: Layout,
    bases: [u64; 2],
    checks: Checks,
}

/// Byte strides of one buffer in one layout: where page `p`, layer `l`, token-in-page `o`,
/// head `h` start, relative to the buffer base (`p*page + l*layer + o*token + h*head`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strides {
    pub(crate) page: u64,
    pub(crate) layer: u64,
    pub(crate) token: u64,
    pub(crate) head: u64,
    /// Bytes of one head row (`D*b`), contiguous in every layout.
    pub(crate) row: u64,
}

/// The three in-page axes, outermost first, in a layout's byte order.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(crate) enum Axis {
    Layer,
    Token,
    Head,
}

impl Layout {
    pub(crate) const fn axis_order(self) -> [Axis; 3] {
        match self {
            Self::LayerFirst | Self::PageFirstDirect => [Axis::Layer, Axis::Token, Axis::Head],
            Self::PageFirst => [Axis::Token, Axis::Layer, Axis::Head],
            Self::PageHead => [Axis::Head, Axis::Token, Axis::Layer],
        }
    }
}

impl Strides {
    pub(crate) const fn of(&self, axis: Axis) -> u64 {
        match axis {
            Axis::Layer => self.layer,
            Axis::Token => self.token,
            Axis::Head => self.head,
        }
    }
}

/// The segments of one buffer (component), coalesced.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct ComponentSegments {
    /// Which buffer.
    pub component: Component,
    /// Its byte runs, in address-friendly order, neighbours merged.
    pub segments: Vec<Segment>,
}

/// The bytes of one layer of a set of pages, per buffer, coalesced.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct LayerView {
    /// The layer.
    pub layer: u64,
    /// One entry per buffer (K then V, or the latent buffer).
    pub components: Vec<ComponentSegments>,
}

impl Pool {
    /// Place a pool at `base`. `v_base` is the V buffer's address: required for `mha-split`,
    /// refused for `mla`, and optional for `mha`, where it defaults to SGLang's
    /// `base + V_OFF` (`V_OFF = L*S*H*D*b`, the K half's size).
    ///
    /// # Errors
    /// [`LayoutError::UnsupportedLayout`] for MLA `page_head`; [`LayoutError::Base`] for a
    /// missing or superfluous V base or overlapping K and V buffers;
    /// [`LayoutError::Overflow`] when a buffer would end beyond 2^64.
    pub fn new(
        geometry: PoolGeometry,
        layout: Layout,
        base: u64,
        v_base: Option<u64>,
    ) -> Result<Self> {
        let kind = geometry.kind();
        if kind == PoolKind::Mla && layout == Layout::PageHead {
            return Err(LayoutError::UnsupportedLayout { kind, layout });
        }
        let k_bytes = geometry.buffer_bytes(Component::K);
        let k_end = add(base, k_bytes, "end of the K buffer")?;
        let v = match (kind, v_base) {
            (PoolKind::Mla, None) => 0,
            (PoolKind::Mla, Some(_)) => {
                return Err(LayoutError::Base {
                    reason: "an mla pool has a single buffer and no V base",
                });
            }
            (PoolKind::MhaSplit, None) => {
                return Err(LayoutError::Base {
                    reason: "an mha-split pool needs a V base address",
                });
            }
            (PoolKind::Mha, None) => k_end,
            (_, Some(v)) => v,
        };
        if kind != PoolKind::Mla {
            let v_end = add(
                v,
                geometry.buffer_bytes(Component::V),
                "end of the V buffer",
            )?;
            if v < k_end && base < v_end {
                return Err(LayoutError::Base {
                    reason: "the K and V buffers overlap",
                });
            }
        }
        Ok(Self {
            geometry,
            layout,
            bases: [base, v],
            checks: Checks::Strict,
        })
    }

    /// The same pool with another level of index checking.
    #[must_use]
    pub const fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = checks;
        self
    }

    /// The geometry.
    pub const fn geometry(&self) -> &PoolGeometry {
        &self.geometry
    }
    /// The layout.
    pub const fn layout(&self) -> Layout {
        self.layout
    }
    /// The index checking level.
    pub const fn checks(&self) -> Checks {
        self.checks
    }
    /// The buffers of this pool (K, V or latent), in SGLang's per-page order.
    pub const fn components(&self) -> &'static [Component] {
        self.geometry.kind().components()
    }

    /// Base address of one buffer.
    pub const fn base(&self, c: Component) -> u64 {
        match c {
            Component::K | Component::Latent => self.bases[0],
            Component::V => self.bases[1],
        }
    }

    /// The whole of one buffer as a segment (what a transport registers).
    pub const fn buffer(&self, c: Component) -> Segment {
        Segment {
            addr: self.base(c),
            len: self.geometry.buffer_bytes(c),
        }
    }

    /// Whether SGLang's `get_page_buffer_meta` answers for this pool kind and layout
    /// (otherwise our output is an extension, see `docs/layout.md`).
    pub const fn sglang_has_meta(&self) -> bool {
        match self.geometry.kind() {
            PoolKind::Mha => true,
            PoolKind::MhaSplit => {
                matches!(self.layout, Layout::PageFirst | Layout::PageFirstDirect)
            }
            PoolKind::Mla => !matches!(self.layout, Layout::PageHead),
        }
    }

    /// Whether SGLang's `get_split_heads_page_buffer_meta` answers (symmetric `page_head`).
    pub const fn sglang_has_split_heads(&self) -> bool {
        matches!(self.geometry.kind(), PoolKind::Mha) && matches!(self.layout, Layout::PageHead)
    }

    pub(crate) const fn strides(&self, c: Component) -> Strides {
        let g = &self.geometry;
        let row = g.row_bytes(c);
        let head_row = g.component_dim(c) * g.dtype_bytes();
        let (l, p) = (g.layers(), g.page_size());
        // All products are at most one buffer's size, which `PoolGeometry` proved fits.
        match self.layout {
            Layout::LayerFirst => Strides {
                page: p * row,
                layer: g.capacity() * row,
                token: row,
                head: head_row,
                row: head_row,
            },
            Layout::PageFirst => Strides {
                page: p * l * row,
                layer: row,
                token: l * row,
                head: head_row,
                row: head_row,
            },
            Layout::PageFirstDirect => Strides {
                page: l * p * row,
                layer: p * row,
                token: row,
                head: head_row,
                row: head_row,
            },
            Layout::PageHead => Strides {
                page: l * p * row,
                layer: head_row,
                token: l * head_row,
                head: p * l * head_row,
                row: head_row,
            },
        }
    }

    /// Address of byte 0 of element (`c`, token slot `slot`, `layer`, `head`, `dim`): the
    /// layout's byte order, spelled out. MLA's latent buffer has one head (`head = 0`).
    ///
    /// # Errors
    /// [`LayoutError::SlotOutOfRange`], [`LayoutError::IndexOutOfRange`], or
    /// [`LayoutError::Base`] for a component the pool does not have.
    pub fn element_addr(
        &self,
        c: Component,
        slot: u64,
        layer: u64,
        head: u64,
        dim: u64,
    ) -> Result<u64> {
        let g = &self.geometry;
        if !self.components().contains(&c) {
            return Err(LayoutError::Base {
                reason: "the pool has no such buffer",
            });
        }
        if slot >= g.capacity() {
            return Err(LayoutError::SlotOutOfRange {
                slot,
                capacity: g.capacity(),
            });
        }
        let check = |axis, index, size| {
            if index < size {
                Ok(())
            } else {
                Err(LayoutError::IndexOutOfRange { axis, index, size })
            }
        };
        check("layer", layer, g.layers())?;
        check("head", head, g.component_heads(c))?;
        check("dim", dim, g.component_dim(c))?;
        let s = self.strides(c);
        let (p, o) = (slot / g.page_size(), slot % g.page_size());
        Ok(self.base(c)
            + p * s.page
            + layer * s.layer
            + o * s.token
            + head * s.head
            + dim * g.dtype_bytes())
    }

    /// Check a request of token indices and return the number of pages.
    fn check_count(&self, indices: &[u64]) -> Result<usize> {
        let p = self.geometry.page_size();
        if !(indices.len() as u64).is_multiple_of(p) {
            return Err(LayoutError::IndexCount {
                count: indices.len(),
                page_size: p,
            });
        }
        Ok((indices.len() as u64 / p) as usize)
    }

    /// Validate one page of token indices (`chunk.len() == P`) and return its first slot.
    #[inline]
    fn page_start(&self, position: usize, chunk: &[u64], aligned_only: bool) -> Result<u64> {
        let t0 = chunk[0];
        self.check_start(position, t0, aligned_only)?;
        let strict = self.checks == Checks::Strict;
        // A branch-free pass first (it vectorises); the slow pass only finds the culprit.
        if strict && mismatch(chunk, t0) {
            for (offset, (&found, expected)) in chunk.iter().zip(t0..).enumerate() {
                if found != expected {
                    return Err(LayoutError::NonConsecutive {
                        position,
                        offset: offset as u64,
                        found,
                        expected,
                    });
                }
            }
        }
        Ok(t0)
    }

    /// The checks of a page's first slot `t0`: inside the pool with the whole page, and
    /// page-aligned under strict checks (or for layouts SGLang refuses).
    #[inline]
    fn check_start(&self, position: usize, t0: u64, aligned_only: bool) -> Result<()> {
        let g = &self.geometry;
        let (p, cap) = (g.page_size(), g.capacity());
        if t0 >= cap {
            return Err(LayoutError::SlotOutOfRange {
                slot: t0,
                capacity: cap,
            });
        }
        let strict = self.checks == Checks::Strict;
        if (strict || aligned_only) && !g.is_page_start(t0) {
            return Err(LayoutError::Misaligned {
                position,
                slot: t0,
                page_size: p,
            });
        }
        // t0 < cap, so t0 + p cannot overflow (cap + p <= 2 * cap, and cap * row fits).
        if t0 + p > cap {
            return Err(LayoutError::SlotOutOfRange {
                slot: t0 + p - 1,
                capacity: cap,
            });
        }
        Ok(())
    }

    /// Whether every first slot passes [`Pool::check_start`]: branch-free folds (they
    /// vectorise), so that only a failing list is walked page by page.
    fn starts_ok(&self, starts: &[u64], aligned_only: bool) -> bool {
        let g = &self.geometry;
        let (p, cap) = (g.page_size(), g.capacity());
        let aligned = self.checks == Checks::Strict || aligned_only;
        let mask = if aligned { g.page_mask() } else { Some(0) };
        match mask {
            Some(mask) => {
                // One pass for both: the largest start, and the OR of the in-page offsets.
                let (max, off) = starts
                    .iter()
                    .fold((0, 0), |(m, o), &t| (m.max(t), o | (t & mask)));
                // max < cap implies max + p cannot overflow (as in `check_start`).
                off == 0 && (starts.is_empty() || (max < cap && max + p <= cap))
            }
            None => starts
                .iter()
                .all(|&t| t < cap && t + p <= cap && g.is_page_start(t)),
        }
    }

    /// Validate a page index and return its first slot.
    #[inline]
    fn page_slot(&self, page: u64) -> Result<u64> {
        let g = &self.geometry;
        if page >= g.pages() {
            return Err(LayoutError::PageOutOfRange {
                page,
                pages: g.pages(),
            });
        }
        Ok(page * g.page_size())
    }

    /// Emit the `get_page_buffer_meta` entries of one page starting at slot `t0`
    /// (already validated: `t0 + P <= S`).
    #[inline(always)]
    fn emit_page(&self, t0: u64, f: &mut impl FnMut(Component, Segment)) {
        let g = &self.geometry;
        let comps = self.components();
        match self.layout {
            Layout::LayerFirst => {
                for l in 0..g.layers() {
                    for &c in comps {
                        f(c, self.layer_first_segment(c, l, t0));
                    }
                }
            }
            _ => {
                let unit = if self.floors_slot() {
                    t0 - t0 % g.page_size()
                } else {
                    t0
                };
                for &c in comps {
                    let addr = self.base(c) + unit * g.layers() * g.row_bytes(c);
                    f(
                        c,
                        Segment {
                            addr,
                            len: g.page_bytes(c),
                        },
                    );
                }
            }
        }
    }

    /// Call `f` for every entry of SGLang's `get_page_buffer_meta(indices)`, in its order,
    /// without allocating. Indices are host token slots, `P` per page.
    ///
    /// Returns the number of pages. On error nothing after the bad page has been emitted, but
    /// the pages before it have (validate with [`Pool::page_meta`] first if that matters).
    ///
    /// # Errors
    /// [`LayoutError::IndexCount`], [`LayoutError::Misaligned`],
    /// [`LayoutError::NonConsecutive`], [`LayoutError::SlotOutOfRange`], and
    /// [`LayoutError::TooManyEntries`] (checked before the first entry) when the request
    /// has more than [`MAX_ENTRIES`] entries.
    pub fn for_each_segment(
        &self,
        indices: &[u64],
        mut f: impl FnMut(Component, Segment),
    ) -> Result<usize> {
        let n = self.check_count(indices)?;
        self.meta_entries(n)?;
        let aligned_only = !self.sglang_has_meta();
        for (pos, chunk) in indices
            .chunks_exact(self.geometry.page_size() as usize)
            .enumerate()
        {
            let t0 = self.page_start(pos, chunk, aligned_only)?;
            self.emit_page(t0, &mut f);
        }
        Ok(n)
    }

    /// Like [`Pool::for_each_segment`], for a list of page indices (`t0 = page * P`).
    ///
    /// # Errors
    /// [`LayoutError::PageOutOfRange`], [`LayoutError::TooManyEntries`].
    pub fn for_each_page_segment(
        &self,
        pages: &[u64],
        mut f: impl FnMut(Component, Segment),
    ) -> Result<usize> {
        self.meta_entries(pages.len())?;
        for &page in pages {
            let t0 = self.page_slot(page)?;
            self.emit_page(t0, &mut f);
        }
        Ok(pages.len())
    }

    /// SGLang's `get_page_buffer_meta(indices)`: pointers and lengths, one entry per
    /// (page, buffer) for page-major layouts and per (page, layer, buffer) for `layer_first`.
    ///
    /// # Errors
    /// As [`Pool::for_each_segment`]; nothing is returned on error.
    pub fn page_meta(&self, indices: &[u64]) -> Result<Segments> {
        let mut out = Segments::default();
        self.page_meta_into(indices, &mut out)?;
        Ok(out)
    }

    /// [`Pool::page_meta`] into a caller's lists (cleared first; their capacity is reused).
    ///
    /// # Errors
    /// As [`Pool::for_each_segment`]; `out` is left empty on error.
    pub fn page_meta_into(&self, indices: &[u64], out: &mut Segments) -> Result<()> {
        out.clear();
        let pages = self.check_count(indices)?;
        let entries = self.meta_entries(pages)?;
        if self.layout.is_page_major() {
            // One pass: validate each page and write its entries (the index array is the
            // bulk of the memory traffic, so it is read once).
            return emptied_on_error(self.fill_page_major_checked(indices, pages, out), out);
        }
        out.reserve(entries);
        emptied_on_error(self.for_each_segment(indices, |_, s| out.push(s)), out)
    }

    /// SGLang's asymmetric pool floors the first slot to the page start for
    /// `page_first_direct`; the symmetric and MLA pools do not. Extensions are always
    /// aligned, so flooring them changes nothing.
    fn floors_slot(&self) -> bool {
        self.geometry.kind() == PoolKind::MhaSplit
            && self.layout == Layout::PageFirstDirect
            && self.checks == Checks::Sglang
    }

    /// Page-major lists from token slots, validating each page on the way.
    fn fill_page_major_checked(
        &self,
        indices: &[u64],
        pages: usize,
        out: &mut Segments,
    ) -> Result<()> {
        let g = &self.geometry;
        let ps = g.page_size();
        let aligned_only = !self.sglang_has_meta();
        let floor = self.floors_slot();
        let chunks = indices.chunks_exact(ps as usize).enumerate();
        let first = |pos, chunk| -> Result<u64> {
            let t0 = self.page_start(pos, chunk, aligned_only)?;
            Ok(if floor { t0 - t0 % ps } else { t0 })
        };
        match *self.components() {
            [c] => {
                let (b, step) = (self.base(c), g.layers() * g.row_bytes(c));
                out.ptrs.resize(pages, 0);
                for ((pos, chunk), ptr) in chunks.zip(out.ptrs.iter_mut()) {
                    *ptr = b + first(pos, chunk)? * step;
                }
                out.lens.resize(pages, g.page_bytes(c));
            }
            [k, v] => {
                let (kb, ks) = (self.base(k), g.layers() * g.row_bytes(k));
                let (vb, vs) = (self.base(v), g.layers() * g.row_bytes(v));
                out.ptrs.resize(2 * pages, 0);
                for ((pos, chunk), pair) in chunks.zip(out.ptrs.chunks_exact_mut(2)) {
                    let t = first(pos, chunk)?;
                    pair[0] = kb + t * ks;
                    pair[1] = vb + t * vs;
                }
                out.lens.resize(2 * pages, 0);
                let (kl, vl) = (g.page_bytes(k), g.page_bytes(v));
                for pair in out.lens.chunks_exact_mut(2) {
                    pair[0] = kl;
                    pair[1] = vl;
                }
            }
            _ => unreachable!("pools have one or two buffers"),
        }
        Ok(())
    }

    /// Page-major lists from each page's (validated) first slot: per page, each buffer at
    /// `base + t0 * L * row`, `L * P * row` long.
    fn fill_page_major(&self, firsts: impl ExactSizeIterator<Item = u64>, out: &mut Segments) {
        let g = &self.geometry;
        let n = firsts.len();
        match *self.components() {
            [c] => {
                let (b, step) = (self.base(c), g.layers() * g.row_bytes(c));
                out.ptrs.extend(firsts.map(|t| b + t * step));
                out.lens.resize(n, g.page_bytes(c));
            }
            [k, v] => {
                // Interleaved K and V entries, built in a small block and appended: each
                // list is written once (no zero-fill first), which matters for long lists.
                let (kb, ks) = (self.base(k), g.layers() * g.row_bytes(k));
                let (vb, vs) = (self.base(v), g.layers() * g.row_bytes(v));
                let mut block = [0u64; 256];
                out.ptrs.reserve(2 * n);
                let mut firsts = firsts;
                loop {
                    let mut m = 0;
                    for (pair, t) in block.chunks_exact_mut(2).zip(firsts.by_ref()) {
                        pair[0] = kb + t * ks;
                        pair[1] = vb + t * vs;
                        m += 2;
                    }
                    if m == 0 {
                        break;
                    }
                    out.ptrs.extend_from_slice(&block[..m]);
                }
                let (kl, vl) = (g.page_bytes(k), g.page_bytes(v));
                for pair in block.chunks_exact_mut(2) {
                    pair[0] = kl;
                    pair[1] = vl;
                }
                out.lens.reserve(2 * n);
                let mut left = 2 * n;
                while left > 0 {
                    let m = left.min(block.len());
                    out.lens.extend_from_slice(&block[..m]);
                    left -= m;
                }
            }
            _ => unreachable!("pools have one or two buffers"),
        }
    }

    /// [`Pool::page_meta`] for page indices.
    ///
    /// # Errors
    /// [`LayoutError::PageOutOfRange`].
    pub fn page_meta_for_pages(&self, pages: &[u64]) -> Result<Segments> {
        let mut out = Segments::default();
        self.page_meta_for_pages_into(pages, &mut out)?;
        Ok(out)
    }

    /// [`Pool::page_meta_for_pages`] into a caller's lists (cleared first; their capacity
    /// is reused, so a warm call allocates nothing).
    ///
    /// # Errors
    /// [`LayoutError::PageOutOfRange`]; `out` is left empty on error.
    pub fn page_meta_for_pages_into(&self, pages: &[u64], out: &mut Segments) -> Result<()> {
        out.clear();
        let entries = self.meta_entries(pages.len())?;
        if self.layout.is_page_major() {
            // One entry per page and buffer at `base + page * page_bytes`: check all pages
            // in one pass, then fill both lists with straight-line loops.
            let n = self.geometry.pages();
            if let Some(&page) = pages.iter().find(|&&p| p >= n) {
                return Err(LayoutError::PageOutOfRange { page, pages: n });
            }
            let ps = self.geometry.page_size();
            self.fill_page_major(pages.iter().map(|&p| p * ps), out);
            return Ok(());
        }
        out.reserve(entries);
        emptied_on_error(self.for_each_page_segment(pages, |_, s| out.push(s)), out)
    }

    /// [`Pool::page_meta_into`] for pages given by their first slots alone, each page `k`
    /// being the slots `starts[k], starts[k]+1, ..., starts[k]+P-1`: the same lists, and the
    /// same error as `page_meta_into` gives for those slots. For a caller that has already
    /// checked that each page of its index array is such a run (the slot-by-slot part of
    /// strict checks), or that runs SGLang's checks (which read only the first slots).
    ///
    /// # Errors
    /// [`LayoutError::SlotOutOfRange`] and [`LayoutError::Misaligned`], for the first bad
    /// page, with its position in `starts`; `out` is left empty on error.
    pub fn page_meta_from_starts_into(&self, starts: &[u64], out: &mut Segments) -> Result<()> {
        out.clear();
        let entries = self.meta_entries(starts.len())?;
        let aligned_only = !self.sglang_has_meta();
        if !self.starts_ok(starts, aligned_only) {
            for (position, &t0) in starts.iter().enumerate() {
                self.check_start(position, t0, aligned_only)?;
            }
        }
        if self.layout.is_page_major() {
            if self.floors_slot() {
                let ps = self.geometry.page_size();
                self.fill_page_major(starts.iter().map(|&t| t - t % ps), out);
            } else {
                self.fill_page_major(starts.iter().copied(), out);
            }
            return Ok(());
        }
        out.reserve(entries);
        for &t0 in starts {
            self.emit_page(t0, &mut |_, s| out.push(s));
        }
        Ok(())
    }

    /// Entries per page of [`Pool::page_meta`].
    /// (Saturates at `usize::MAX` for absurd layer counts.)
    pub fn entries_per_page(&self) -> usize {
        let comps = self.components().len();
        match self.layout {
            Layout::LayerFirst => usize::try_from(self.geometry.layers())
                .map_or(usize::MAX, |l| comps.saturating_mul(l)),
            _ => comps,
        }
    }

    /// The number of entries of [`Pool::page_meta`] for `pages` pages, checked before
    /// anything is reserved.
    ///
    /// # Errors
    /// [`LayoutError::TooManyEntries`] when it is more than [`MAX_ENTRIES`] (a `layer_first`
    /// pool of an absurd layer count has that many in one page).
    pub fn meta_entries(&self, pages: usize) -> Result<usize> {
        let comps = self.components().len() as u64;
        match self.layout {
            Layout::LayerFirst => entries(
                "page_meta of pages x layers x buffers",
                &[pages as u64, self.geometry.layers(), comps],
            ),
            _ => entries("page_meta of pages x buffers", &[pages as u64, comps]),
        }
    }

    /// The number of entries of [`Pool::split_heads_meta`] for `pages` pages and `factor`
    /// head groups, checked before anything is reserved.
    ///
    /// # Errors
    /// [`LayoutError::TooManyEntries`] when it is more than [`MAX_ENTRIES`].
    pub fn split_heads_entries(&self, pages: usize, factor: u64) -> Result<usize> {
        entries(
            "split_heads_meta of pages x factor x buffers",
            &[pages as u64, factor, self.components().len() as u64],
        )
    }

    /// Blocks of one layer of `pages` pages, all buffers (before merging): what
    /// [`Pool::for_each_layer_segment`] emits.
    fn layer_blocks(&self, pages: usize) -> u128 {
        let g = &self.geometry;
        let per_page: u128 = self
            .components()
            .iter()
            .map(|&c| {
                let s = self.strides(c);
                u128::from(Walk::new(self.axes(1, g.component_heads(c), &s, &s), s.row).blocks())
            })
            .sum();
        per_page * pages as u128
    }

    fn check_split(&self, factor: u64) -> Result<()> {
        let g = &self.geometry;
        if self.layout != Layout::PageHead || g.kind() == PoolKind::Mla {
            return Err(LayoutError::SplitHeadsLayout {
                kind: g.kind(),
                layout: self.layout,
            });
        }
        if factor == 0 || !g.heads().is_multiple_of(factor) {
            return Err(LayoutError::SplitFactor {
                factor,
                heads: g.heads(),
            });
        }
        Ok(())
    }

    /// Call `f` for every entry of SGLang's
    /// `get_split_heads_page_buffer_meta(indices, factor)`: per page, per head group
    /// `g < factor`, K then V, each `H/factor` heads of the page (`page_head` only).
    ///
    /// # Errors
    /// [`LayoutError::SplitHeadsLayout`], [`LayoutError::SplitFactor`], the index errors
    /// of [`Pool::for_each_segment`], and [`LayoutError::TooManyEntries`].
    pub fn for_each_split_heads_segment(
        &self,
        indices: &[u64],
        factor: u64,
        mut f: impl FnMut(Component, Segment),
    ) -> Result<usize> {
        self.check_split(factor)?;
        let n = self.check_count(indices)?;
        self.split_heads_entries(n, factor)?;
        let g = &self.geometry;
        let aligned_only = !self.sglang_has_split_heads();
        let hg = g.heads() / factor;
        for (pos, chunk) in indices.chunks_exact(g.page_size() as usize).enumerate() {
            let t0 = self.page_start(pos, chunk, aligned_only)?;
            for group in 0..factor {
                for &c in self.components() {
                    let s = self.strides(c);
                    let addr =
                        self.base(c) + t0 * g.layers() * g.row_bytes(c) + group * hg * s.head;
                    f(
                        c,
                        Segment {
                            addr,
                            len: hg * s.head,
                        },
                    );
                }
            }
        }
        Ok(n)
    }

    /// SGLang's `get_split_heads_page_buffer_meta(indices, factor)` (and the same for
    /// `mha-split` `page_head`, which SGLang refuses).
    ///
    /// # Errors
    /// As [`Pool::for_each_split_heads_segment`].
    pub fn split_heads_meta(&self, indices: &[u64], factor: u64) -> Result<Segments> {
        let mut out = Segments::default();
        self.for_each_split_heads_segment(indices, factor, |_, s| out.push(s))?;
        Ok(out)
    }

    /// The bytes of the pages, per buffer, with neighbours merged (not SGLang's shape: one
    /// entry no longer matches one store key). For `layer_first` the runs are listed layer
    /// by layer, so adjacent pages of one layer merge.
    ///
    /// # Errors
    /// As [`Pool::for_each_segment`].
    pub fn coalesced_meta(&self, indices: &[u64]) -> Result<Vec<ComponentSegments>> {
        // The blocks before merging are page_meta's entries: bound the work up front.
        self.meta_entries(self.check_count(indices)?)?;
        let mut out = self.empty_component_segments();
        let slot = |c: Component| usize::from(c == Component::V);
        if self.layout == Layout::LayerFirst {
            // Validate everything first, then walk layer-major.
            let starts = self.page_starts(indices)?;
            let g = &self.geometry;
            for l in 0..g.layers() {
                for &t0 in &starts {
                    for &c in self.components() {
                        let seg = self.layer_first_segment(c, l, t0);
                        push_coalesced(&mut out[slot(c)].segments, seg);
                    }
                }
            }
        } else {
            self.for_each_segment(indices, |c, s| {
                push_coalesced(&mut out[slot(c)].segments, s);
            })?;
        }
        Ok(out)
    }

    /// Validate `indices` and return each page's first slot.
    fn page_starts(&self, indices: &[u64]) -> Result<Vec<u64>> {
        let n = self.check_count(indices)?;
        let aligned_only = !self.sglang_has_meta();
        let mut starts = Vec::with_capacity(n);
        for (pos, chunk) in indices
            .chunks_exact(self.geometry.page_size() as usize)
            .enumerate()
        {
            starts.push(self.page_start(pos, chunk, aligned_only)?);
        }
        Ok(starts)
    }

    /// Call `f` for the byte runs of one layer of the pages, per page and buffer, in address
    /// order inside each page: one run per page in `layer_first` and `page_first_direct`,
    /// one per token in `page_first`, one per (head, token) in `page_head`.
    ///
    /// # Errors
    /// [`LayoutError::IndexOutOfRange`] for the layer, the index errors of
    /// [`Pool::for_each_segment`] (pages must be aligned here, whatever the checks), and
    /// [`LayoutError::TooManyEntries`] for more than [`MAX_ENTRIES`] blocks.
    pub fn for_each_layer_segment(
        &self,
        indices: &[u64],
        layer: u64,
        mut f: impl FnMut(Component, Segment),
    ) -> Result<usize> {
        let g = &self.geometry;
        if layer >= g.layers() {
            return Err(LayoutError::IndexOutOfRange {
                axis: "layer",
                index: layer,
                size: g.layers(),
            });
        }
        let n = self.check_count(indices)?;
        entries_of(
            "layer segments of pages x blocks per page",
            self.layer_blocks(n),
        )?;
        for (pos, chunk) in indices.chunks_exact(g.page_size() as usize).enumerate() {
            let t0 = self.page_start(pos, chunk, true)?;
            let page = t0 / g.page_size();
            for &c in self.components() {
                let s = self.strides(c);
                let start = self.base(c) + page * s.page + layer * s.layer;
                let w = Walk::new(self.axes(1, g.component_heads(c), &s, &s), s.row);
                w.run(start, start, &mut |addr, _, len| {
                    f(c, Segment { addr, len });
                });
            }
        }
        Ok(n)
    }

    /// The bytes of one layer of the pages, per buffer, neighbours merged.
    ///
    /// # Errors
    /// As [`Pool::for_each_layer_segment`].
    pub fn layer_view(&self, indices: &[u64], layer: u64) -> Result<LayerView> {
        let mut components = self.empty_component_segments();
        self.for_each_layer_segment(indices, layer, |c, s| {
            let i = usize::from(c == Component::V);
            push_coalesced(&mut components[i].segments, s);
        })?;
        Ok(LayerView { layer, components })
    }

    /// One empty list per buffer, in the order of [`Pool::components`].
    fn empty_component_segments(&self) -> Vec<ComponentSegments> {
        self.components()
            .iter()
            .map(|&component| ComponentSegments {
                component,
                segments: Vec::new(),
            })
            .collect()
    }

    /// Layer `l` of the page starting at slot `t0` in buffer `c` of a `layer_first` pool.
    fn layer_first_segment(&self, c: Component, l: u64, t0: u64) -> Segment {
        let g = &self.geometry;
        Segment {
            addr: self.base(c) + (l * g.capacity() + t0) * g.row_bytes(c),
            len: g.layer_page_bytes(c),
        }
    }

    /// [`Pool::layer_view`] for every layer.
    ///
    /// # Errors
    /// As [`Pool::for_each_layer_segment`].
    pub fn layer_views(&self, indices: &[u64]) -> Result<Vec<LayerView>> {
        let n = self.check_count(indices)?;
        let per_layer = self.layer_blocks(n);
        entries_of(
            "layer views of layers x pages x blocks per page",
            per_layer.saturating_mul(u128::from(self.geometry.layers())),
        )?;
        (0..self.geometry.layers())
            .map(|l| self.layer_view(indices, l))
            .collect()
    }

    /// The in-page axes in this layout's order, with the given layer and head counts
    /// (tokens: the whole page) and the strides of both ends.
    pub(crate) fn axes(
        &self,
        layers: u64,
        heads: u64,
        src: &Strides,
        dst: &Strides,
    ) -> [WalkAxis; 3] {
        self.layout.axis_order().map(|a| WalkAxis {
            count: match a {
                Axis::Layer => layers,
                Axis::Token => self.geometry.page_size(),
                Axis::Head => heads,
            },
            src: src.of(a),
            dst: dst.of(a),
        })
    }
}

/// Whether `chunk` differs anywhere from `t0, t0+1, ...` (no early exit, so it vectorises).
#[inline]
fn mismatch(chunk: &[u64], t0: u64) -> bool {
    let mut diff = 0u64;
    let mut want = t0;
    for &x in chunk {
        diff |= x ^ want;
        want = want.wrapping_add(1);
    }
    diff != 0
}

/// One loop of a [`Walk`]: `count` steps of `src` bytes on one side and `dst` on the other.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WalkAxis {
    pub(crate) count: u64,
    pub(crate) src: u64,
    pub(crate) dst: u64,
}

/// A 3-deep loop nest of `unit`-byte rows (outermost axis first) with the inner axes that
/// are contiguous on both sides folded into one block. Built once, run per page.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Walk {
    /// The loops left after folding; folded ones become single steps.
    axes: [WalkAxis; 3],
    /// Bytes per block.
    len: u64,
    /// Whether the whole nest folded into one block.
    single: bool,
}

impl Walk {
    pub(crate) fn new(axes: [WalkAxis; 3], unit: u64) -> Self {
        let mut len = unit;
        let mut outer = 3;
        if axes.iter().any(|a| a.count == 0) {
            len = 0;
        } else {
            while outer > 0 {
                let a = axes[outer - 1];
                if a.count == 1 || (a.src == len && a.dst == len) {
                    len *= a.count;
                    outer -= 1;
                } else {
                    break;
                }
            }
        }
        let one = WalkAxis {
            count: 1,
            src: 0,
            dst: 0,
        };
        let ax = |i: usize| if i < outer { axes[i] } else { one };
        Self {
            axes: [ax(0), ax(1), ax(2)],
            len,
            single: outer == 0,
        }
    }

    /// Blocks per run: the product of the loop counts left after folding (at most
    /// `L*P*H`, which a valid geometry keeps below 2^57).
    pub(crate) fn blocks(&self) -> u64 {
        if self.len == 0 {
            return 0;
        }
        self.axes.iter().map(|a| a.count).product()
    }

    /// Bytes per block.
    pub(crate) const fn len(&self) -> u64 {
        self.len
    }

    /// Whether each run is one block of [`Walk::len`] bytes.
    pub(crate) const fn is_single(&self) -> bool {
        self.single
    }

    /// `f(src, dst, len)` for each block, in loop order.
    #[inline(always)]
    pub(crate) fn run(&self, src: u64, dst: u64, f: &mut impl FnMut(u64, u64, u64)) {
        if self.len == 0 {
            return;
        }
        if self.single {
            f(src, dst, self.len);
            return;
        }
        let [a0, a1, a2] = self.axes;
        for i in 0..a0.count {
            let (s0, d0) = (src + i * a0.src, dst + i * a0.dst);
            for j in 0..a1.count {
                let (s1, d1) = (s0 + j * a1.src, d0 + j * a1.dst);
                for k in 0..a2.count {
                    f(s1 + k * a2.src, d1 + k * a2.dst, self.len);
                }
            }
        }
    }
}

/// A count of entries against [`MAX_ENTRIES`].
fn entries_of(what: &'static str, count: u128) -> Result<usize> {
    crate::error::bounded(what, "entries", count, MAX_ENTRIES as u64).map(|n| n as usize)
}

/// `r` without its value, and `out` emptied when it is an error: the `_into` calls leave
/// no half-filled lists behind.
fn emptied_on_error<T>(r: Result<T>, out: &mut Segments) -> Result<()> {
    if r.is_err() {
        out.clear();
    }
    r.map(|_| ())
}
