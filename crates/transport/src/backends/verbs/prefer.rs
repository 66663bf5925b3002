//! Which rails carry a batch, by where its local memory is.
//!
//! At registration the backend asks the [`Placement`] (topology rule or priority list)
//! for the registration's tiers of rails and remembers them here as bit masks, by the
//! registration's rail-0 lkey. When a batch is striped, each registration it reads or
//! writes locally contributes its first tier that still has a usable rail; the stripe
//! uses the union of those, so a batch on one registration stays on that memory's nearest
//! rails and moves to the next tier only when every rail of the first is out. A
//! registration with no preference (one tier, unknown memory) allows every rail: with
//! one rail or no topology the stripe is what it was.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use smallvec::SmallVec;

use crate::core::topology::{MemoryLocation, Placement};
use crate::types::MAX_RAILS;

/// One bit per rail.
type Mask = u32;

/// A registration's tiers, nearest first.
type Tiers = SmallVec<[Mask; 4]>;

const _: () = assert!(MAX_RAILS <= Mask::BITS as usize);

fn masks(tiers: &[Vec<usize>]) -> Tiers {
    tiers
        .iter()
        .map(|t| t.iter().fold(0, |m, &r| m | (1 << r)))
        .collect()
}

/// The rails a registration with `tiers` may use when `usable` are up: its first tier
/// with a usable rail, or (no tier has one) every usable rail.
fn allowed(tiers: &[Mask], usable: Mask) -> Mask {
    tiers
        .iter()
        .map(|t| t & usable)
        .find(|&m| m != 0)
        .unwrap_or(usable)
}

/// Every registration's rail tiers.
#[derive(Debug, Default)]
pub(crate) struct RailPrefs {
    /// Whether any registration has a preference (skips the lock when none does).
    any: AtomicBool,
    by_lkey: RwLock<HashMap<u32, Tiers>>,
}

impl RailPrefs {
    /// Records the rails for the registration whose rail-0 lkey is `lkey` (nothing to
    /// record when every rail is as near as any other).
    pub fn remember(&self, lkey: u32, tiers: &[Vec<usize>]) {
        let mut m = self.by_lkey.write().unwrap_or_else(|p| p.into_inner());
        if tiers.len() > 1 {
            m.insert(lkey, masks(tiers));
        } else {
            m.remove(&lkey);
        }
        self.any.store(!m.is_empty(), Ordering::Release);
    }

    pub fn forget(&self, lkey: u32) {
        let mut m = self.by_lkey.write().unwrap_or_else(|p| p.into_inner());
        if m.remove(&lkey).is_some() {
            self.any.store(!m.is_empty(), Ordering::Release);
        }
    }

    /// Zeroes the weight of every rail the batch's local registrations (`lkeys`, one per
    /// op, rail-0 keys) should not use now. `weights` is 0 for a rail that is out.
    pub fn restrict(&self, lkeys: impl Iterator<Item = u32>, weights: &mut [u64]) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let usable: Mask = weights
            .iter()
            .enumerate()
            .filter(|(_, w)| **w > 0)
            .fold(0, |m, (r, _)| m | (1 << r));
        let map = self.by_lkey.read().unwrap_or_else(|p| p.into_inner());
        let mut union: Mask = 0;
        let mut last = None;
        for lkey in lkeys {
            // Ops of one batch nearly always name one registration: look it up once.
            if last == Some(lkey) {
                continue;
            }
            last = Some(lkey);
            union |= map.get(&lkey).map_or(usable, |t| allowed(t, usable));
            if union == usable {
                return;
            }
        }
        if union == 0 {
            return;
        }
        for (r, w) in weights.iter_mut().enumerate() {
            if union & (1 << r) == 0 {
                *w = 0;
            }
        }
    }
}

/// The tiers `placement` gives memory at `loc`, and a log line saying so.
pub(crate) fn tiers_for(placement: &Placement, loc: &MemoryLocation) -> Vec<Vec<usize>> {
    let c = placement.choice(loc);
    if c.is_selective() {
        let names = |t: &Vec<usize>| {
            t.iter()
                .map(|&r| placement.rails()[r].name.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        tracing::debug!(
            memory = %loc,
            rails = %c.tiers.iter().map(names).collect::<Vec<_>>().join(" / "),
            source = ?c.source,
            "rail preference"
        );
    }
    c.tiers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_tier_with_a_usable_rail() {
        let t = masks(&[vec![0], vec![1, 2], vec![3]]);
        assert_eq!(t.as_slice(), [0b0001, 0b0110, 0b1000]);
        assert_eq!(allowed(&t, 0b1111), 0b0001);
        assert_eq!(allowed(&t, 0b1110), 0b0110);
        assert_eq!(allowed(&t, 0b1010), 0b0010);
        assert_eq!(allowed(&t, 0b1000), 0b1000);
        assert_eq!(allowed(&t, 0), 0);
    }

    #[test]
    fn batches_keep_to_their_memory_s_rails() {
        let p = RailPrefs::default();
        let mut w = [100, 100, 200, 200];
        // Nobody has a preference: untouched.
        p.restrict([7u32].into_iter(), &mut w);
        assert_eq!(w, [100, 100, 200, 200]);

        p.remember(7, &[vec![2, 3], vec![0, 1]]);
        p.remember(8, &[vec![0], vec![1], vec![2, 3]]);
        p.remember(9, &[vec![0, 1, 2, 3]]); // one tier: no preference, not kept
        let run = |lkeys: &[u32], mut w: [u64; 4]| {
            p.restrict(lkeys.iter().copied(), &mut w);
            w
        };
        assert_eq!(run(&[7, 7, 7], [100, 100, 200, 200]), [0, 0, 200, 200]);
        assert_eq!(run(&[8], [100, 100, 200, 200]), [100, 0, 0, 0]);
        // Rail 0 out: registration 8 moves to its next tier.
        assert_eq!(run(&[8], [0, 100, 200, 200]), [0, 100, 0, 0]);
        // Two registrations: the union of what each may use.
        assert_eq!(run(&[7, 8, 7], [100, 100, 200, 200]), [100, 0, 200, 200]);
        // A registration without a preference allows every rail.
        assert_eq!(run(&[8, 9], [100, 100, 200, 200]), [100, 100, 200, 200]);
        assert_eq!(run(&[8, 42], [100, 100, 200, 200]), [100, 100, 200, 200]);
        // Every preferred rail out: whatever is usable.
        assert_eq!(run(&[7], [0, 0, 0, 50]), [0, 0, 0, 50]);
        p.forget(7);
        p.forget(8);
        assert_eq!(run(&[7, 8], [100, 100, 200, 200]), [100, 100, 200, 200]);
        assert!(!p.any.load(Ordering::Acquire));
    }
}
