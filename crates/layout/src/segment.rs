//! Byte segments and segment lists.

/// One contiguous byte run: an address (a plain integer; this crate touches no memory)
/// and a length.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub struct Segment {
    /// First byte.
    pub addr: u64,
    /// Number of bytes.
    pub len: u64,
}

impl Segment {
    /// One past the last byte. Segments produced by this crate never overflow here.
    pub const fn end(&self) -> u64 {
        self.addr + self.len
    }
}

/// A segment list in SGLang's `get_page_buffer_meta` shape: parallel pointer and length
/// lists, one entry per (page, buffer[, layer | head group]).
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Segments {
    /// Start addresses.
    pub ptrs: Vec<u64>,
    /// Lengths in bytes, parallel to `ptrs`.
    pub lens: Vec<u64>,
}

impl Segments {
    /// An empty list with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            ptrs: Vec::with_capacity(n),
            lens: Vec::with_capacity(n),
        }
    }

    /// Make room for `n` more entries, but never reserve more than 2^20 at once up front:
    /// an absurd request should fail as it grows, not abort in `reserve`.
    pub fn reserve(&mut self, n: usize) {
        let n = n.min(1 << 20);
        self.ptrs.reserve(n);
        self.lens.reserve(n);
    }

    /// Append one entry.
    #[inline]
    pub fn push(&mut self, s: Segment) {
        self.ptrs.push(s.addr);
        self.lens.push(s.len);
    }

    /// Remove all entries, keeping the allocations.
    pub fn clear(&mut self) {
        self.ptrs.clear();
        self.lens.clear();
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.ptrs.is_empty()
    }

    /// The entries as [`Segment`]s, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Segment> + '_ {
        self.ptrs
            .iter()
            .zip(&self.lens)
            .map(|(&addr, &len)| Segment { addr, len })
    }

    /// Sum of the lengths.
    pub fn total_bytes(&self) -> u64 {
        self.lens.iter().sum()
    }
}

impl FromIterator<Segment> for Segments {
    fn from_iter<I: IntoIterator<Item = Segment>>(iter: I) -> Self {
        let mut out = Self::default();
        out.extend(iter);
        out
    }
}

impl Extend<Segment> for Segments {
    fn extend<I: IntoIterator<Item = Segment>>(&mut self, iter: I) {
        for s in iter {
            self.push(s);
        }
    }
}

/// Append `s` to `out`, merging it into the last entry when it starts where that one ends.
#[inline]
pub fn push_coalesced(out: &mut Vec<Segment>, s: Segment) {
    if let Some(last) = out.last_mut()
        && last.end() == s.addr
    {
        last.len += s.len;
        return;
    }
    if s.len > 0 {
        out.push(s);
    }
}

/// Merge neighbours in list order where one ends exactly where the next starts.
///
/// Order is kept and nothing is sorted, so the result covers exactly the same bytes in the
/// same order; it only has fewer entries. Zero-length entries are dropped.
pub fn coalesce(segments: impl IntoIterator<Item = Segment>) -> Vec<Segment> {
    let mut out = Vec::new();
    for s in segments {
        push_coalesced(&mut out, s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_only_neighbours_in_order() {
        let s = |addr, len| Segment { addr, len };
        let got = coalesce([s(0, 4), s(4, 4), s(16, 2), s(8, 8), s(18, 2), s(20, 0)]);
        assert_eq!(got, vec![s(0, 8), s(16, 2), s(8, 8), s(18, 2)]);
        let segs: Segments = got.iter().copied().collect();
        assert_eq!(segs.total_bytes(), 20);
        assert_eq!(segs.ptrs, vec![0, 16, 8, 18]);
    }
}
