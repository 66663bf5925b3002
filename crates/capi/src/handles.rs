//! Generation-checked handle tables.
//!
//! Every handle the C ABI hands out (an engine, a region, a peer, a `pagewire.h`
//! batch) is a 64-bit token that indexes a table, never a pointer: `magic:16 |
//! generation:16 | index+1:32`. A lookup checks all three parts, so a handle that was
//! never issued, was freed or belongs to another table is refused with an error instead
//! of being dereferenced. (Mooncake batch ids are `pagewire_mooncake`'s, per engine.)

/// Largest number of live entries in one table (keeps tokens clear of `u64::MAX` and
/// the tables bounded whatever the caller does).
pub(crate) const MAX_ENTRIES: usize = 1 << 20;

#[derive(Debug)]
struct Slot<T> {
    generation: u16,
    value: Option<T>,
}

/// A slab of `T` addressed by tokens.
#[derive(Debug)]
pub(crate) struct HandleTable<T> {
    magic: u16,
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> HandleTable<T> {
    /// An empty table whose tokens carry `magic` in their top 16 bits.
    pub(crate) const fn new(magic: u16) -> Self {
        HandleTable {
            magic,
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }

    fn token(&self, index: u32, generation: u16) -> u64 {
        (u64::from(self.magic) << 48) | (u64::from(generation) << 32) | (u64::from(index) + 1)
    }

    fn split(&self, token: u64) -> Option<(usize, u16)> {
        if (token >> 48) as u16 != self.magic {
            return None;
        }
        let low = (token & 0xffff_ffff) as u32;
        let index = low.checked_sub(1)? as usize;
        Some((index, (token >> 32) as u16))
    }

    /// Stores `value`; `None` when the table is full.
    pub(crate) fn insert(&mut self, value: T) -> Option<u64> {
        if self.live >= MAX_ENTRIES {
            return None;
        }
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.value = Some(value);
        self.live += 1;
        let generation = slot.generation;
        Some(self.token(index, generation))
    }

    /// The entry behind `token`, if it is live.
    pub(crate) fn get(&self, token: u64) -> Option<&T> {
        let (index, generation) = self.split(token)?;
        let slot = self.slots.get(index)?;
        if slot.generation != generation {
            return None;
        }
        slot.value.as_ref()
    }

    /// Removes and returns the entry behind `token`; the token is dead afterwards.
    pub(crate) fn remove(&mut self, token: u64) -> Option<T> {
        let (index, generation) = self.split(token)?;
        let slot = self.slots.get_mut(index)?;
        if slot.generation != generation {
            return None;
        }
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(index as u32);
        self.live -= 1;
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_die_with_their_entry_and_never_alias() {
        let mut t = HandleTable::new(0xabcd);
        let a = t.insert("a").unwrap();
        let b = t.insert("b").unwrap();
        assert_ne!(a, b);
        assert_eq!(t.get(a), Some(&"a"));
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(t.get(a), None, "freed");
        assert_eq!(t.remove(a), None, "double free");
        let c = t.insert("c").unwrap();
        assert_ne!(c, a, "slot reused with a new generation");
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(c), Some(&"c"));
        for bad in [0, u64::MAX, 1, c ^ (1 << 48), c & !0xffff_ffff] {
            assert_eq!(t.get(bad), None, "{bad:#x}");
        }
        assert_eq!(t.remove(b), Some("b"));
        assert_eq!(t.remove(c), Some("c"));
        assert_eq!(t.get(b), None);
        assert!(t.insert("d").is_some());
    }

    #[test]
    fn another_tables_tokens_are_refused() {
        let mut t1 = HandleTable::new(1);
        let t2: HandleTable<u8> = HandleTable::new(2);
        let a = t1.insert(7u8).unwrap();
        assert_eq!(t2.get(a), None);
    }
}
