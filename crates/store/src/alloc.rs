//! Space allocation inside one segment: best fit over a free list kept twice (by offset,
//! to merge neighbours on free; by length, to find the smallest block that fits), so both
//! operations are O(log n) in the number of free blocks.

use std::collections::{BTreeMap, BTreeSet};

/// Allocation granule: every block starts and ends on a multiple of this (cache line).
pub const ALIGN: u64 = 64;

/// `len` rounded up to [`ALIGN`], or `None` on overflow.
pub fn aligned(len: u64) -> Option<u64> {
    len.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

/// Free-space bookkeeping of one segment of `size` bytes (offsets relative to its base).
#[derive(Debug, Clone)]
pub struct Allocator {
    size: u64,
    by_off: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    used: u64,
}

impl Allocator {
    /// An empty segment; the usable size is `size` rounded down to [`ALIGN`].
    pub fn new(size: u64) -> Self {
        let size = size & !(ALIGN - 1);
        let mut a = Allocator {
            size,
            by_off: BTreeMap::new(),
            by_len: BTreeSet::new(),
            used: 0,
        };
        if size > 0 {
            a.insert(0, size);
        }
        a
    }

    fn insert(&mut self, off: u64, len: u64) {
        self.by_off.insert(off, len);
        self.by_len.insert((len, off));
    }

    fn remove(&mut self, off: u64, len: u64) {
        self.by_off.remove(&off);
        self.by_len.remove(&(len, off));
    }

    /// Usable bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes allocated (aligned sizes).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The largest block that [`alloc`](Self::alloc) could return now.
    pub fn largest_free(&self) -> u64 {
        self.by_len.last().map_or(0, |&(len, _)| len)
    }

    /// Reserves `len` bytes (rounded up to [`ALIGN`]); returns the offset, or `None` when
    /// no free block is large enough. Takes the smallest block that fits, lowest offset
    /// first among equals.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let need = aligned(len.max(1))?;
        let &(blen, off) = self.by_len.range((need, 0)..).next()?;
        self.remove(off, blen);
        if blen > need {
            self.insert(off + need, blen - need);
        }
        self.used += need;
        Some(off)
    }

    /// Reserves exactly `[off, off + len)` (`len` rounded up to [`ALIGN`]) if it is free:
    /// a standby rebuilds the allocations of the objects the leader logged. `false` when
    /// the range is not aligned, not inside the segment or not free.
    pub fn take(&mut self, off: u64, len: u64) -> bool {
        let Some(need) = aligned(len.max(1)) else {
            return false;
        };
        let Some(end) = off.checked_add(need) else {
            return false;
        };
        if !off.is_multiple_of(ALIGN) || end > self.size {
            return false;
        }
        let Some((&fo, &fl)) = self.by_off.range(..=off).next_back() else {
            return false;
        };
        if fo + fl < end {
            return false;
        }
        self.remove(fo, fl);
        if fo < off {
            self.insert(fo, off - fo);
        }
        if end < fo + fl {
            self.insert(end, fo + fl - end);
        }
        self.used += need;
        true
    }

    /// Returns a block that [`alloc`](Self::alloc) gave out with this `len`.
    ///
    /// # Panics
    /// In debug builds, when the block overlaps free space or lies outside the segment
    /// (a double free): the master's bookkeeping is then wrong.
    pub fn free(&mut self, off: u64, len: u64) {
        let Some(mut len) = aligned(len.max(1)) else {
            debug_assert!(false, "free of an impossible length {len}");
            return;
        };
        debug_assert!(
            off.is_multiple_of(ALIGN) && off.checked_add(len).is_some_and(|e| e <= self.size)
        );
        debug_assert!(
            self.by_off
                .range(..off + len)
                .next_back()
                .is_none_or(|(&o, &l)| o + l <= off),
            "double free at {off:#x}+{len:#x}"
        );
        self.used -= len;
        let mut off = off;
        // Merge with the block before and the block after.
        if let Some((&po, &pl)) = self.by_off.range(..off).next_back()
            && po + pl == off
        {
            self.remove(po, pl);
            off = po;
            len += pl;
        }
        if let Some(&nl) = self.by_off.get(&(off + len)) {
            self.remove(off + len, nl);
            len += nl;
        }
        self.insert(off, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_merge() {
        let mut a = Allocator::new(1024);
        assert_eq!(a.size(), 1024);
        let x = a.alloc(100).unwrap(); // 128
        let y = a.alloc(64).unwrap();
        let z = a.alloc(1).unwrap();
        assert_eq!((x, y, z), (0, 128, 192));
        assert_eq!(a.used(), 256);
        a.free(y, 64);
        // The 64-byte hole is the best fit for 64 bytes, not the tail.
        assert_eq!(a.alloc(60), Some(128));
        a.free(128, 60);
        a.free(x, 100);
        a.free(z, 1);
        assert_eq!(a.used(), 0);
        assert_eq!(a.largest_free(), 1024);
        assert_eq!(a.alloc(1025), None);
        assert_eq!(a.alloc(1024), Some(0));
        assert_eq!(a.alloc(1), None);
        assert_eq!(Allocator::new(63).alloc(1), None);
        assert_eq!(aligned(u64::MAX), None);
    }

    /// Operations on the allocator and a byte map at once.
    #[derive(Debug, Clone)]
    enum Step {
        Alloc(u64),
        Free(usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        proptest::collection::vec(
            prop_oneof![
                (1u64..600).prop_map(Step::Alloc),
                any::<usize>().prop_map(Step::Free)
            ],
            1..200,
        )
    }

    /// A standby's rebuild: taking the blocks another allocator gave out reproduces its
    /// usage, a taken block cannot be taken again, and later blocks never overlap them.
    #[test]
    fn take_rebuilds_another_allocators_blocks() {
        let mut a = Allocator::new(1 << 16);
        let blocks: Vec<(u64, u64)> = [100u64, 64, 4000, 1, 640, 129]
            .iter()
            .map(|&l| (a.alloc(l).unwrap(), l))
            .collect();
        a.free(blocks[1].0, blocks[1].1);
        let live: Vec<(u64, u64)> = blocks.iter().copied().filter(|b| *b != blocks[1]).collect();
        let mut b = Allocator::new(1 << 16);
        for &(off, len) in &live {
            assert!(b.take(off, len), "{off} {len}");
            assert!(!b.take(off, len), "taken twice");
        }
        assert_eq!(b.used(), a.used());
        assert!(!b.take(3, 64), "unaligned");
        assert!(!b.take(1 << 16, 64), "outside");
        while let Some(off) = b.alloc(256) {
            assert!(
                live.iter()
                    .all(|&(o, l)| off + 256 <= o || o + aligned(l).unwrap() <= off)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Against a map of granules: blocks never overlap, stay inside, and an allocation
        /// fails only when no run of free granules is long enough.
        #[test]
        fn matches_a_granule_map(steps in steps(), size in 64u64..4096) {
            let mut a = Allocator::new(size);
            let granules = (size / ALIGN) as usize;
            let mut map = vec![false; granules];
            let mut live: Vec<(u64, u64)> = Vec::new();
            for s in steps {
                match s {
                    Step::Alloc(len) => {
                        let need = (aligned(len).unwrap() / ALIGN) as usize;
                        let longest = map
                            .split(|&b| b)
                            .map(|run| run.len())
                            .max()
                            .unwrap_or(0);
                        match a.alloc(len) {
                            Some(off) => {
                                let g = (off / ALIGN) as usize;
                                prop_assert!(g + need <= granules);
                                prop_assert!(map[g..g + need].iter().all(|&b| !b));
                                map[g..g + need].iter_mut().for_each(|b| *b = true);
                                live.push((off, len));
                            }
                            None => prop_assert!(longest < need, "refused {need} with a run of {longest}"),
                        }
                    }
                    Step::Free(i) if !live.is_empty() => {
                        let (off, len) = live.swap_remove(i % live.len());
                        let g = (off / ALIGN) as usize;
                        let need = (aligned(len).unwrap() / ALIGN) as usize;
                        map[g..g + need].iter_mut().for_each(|b| *b = false);
                        a.free(off, len);
                    }
                    Step::Free(_) => {}
                }
                let used = map.iter().filter(|&&b| b).count() as u64 * ALIGN;
                prop_assert_eq!(a.used(), used);
            }
            for (off, len) in live.drain(..) {
                a.free(off, len);
            }
            prop_assert_eq!(a.largest_free(), a.size());
        }
    }
}
