//! A sharded store's key space: which shard (leader group of masters) owns a key, how a
//! client batch is split by shard and put back together, and how a storage node's
//! segment is carved into one part per shard.
//!
//! The hash is part of the cluster's format: every client of a cluster must route a key
//! to the same shard, across versions. [`shard_of`] is FNV-1a 64 of the key's bytes,
//! mixed by MurmurHash3's 64-bit finalizer, modulo the shard count; its values are
//! pinned by a test. (FNV-1a alone makes a poor modulus: its lowest bit is the parity of
//! the bytes' lowest bits, so two shards would split keys by that parity.)

use std::sync::Mutex;

use crate::error::{Code, Result, StoreError};
use crate::proto::Stats;

/// Most shards a cluster may have (a client holds one master link, heartbeat thread and
/// locator per shard).
pub const MAX_SHARDS: usize = 256;

/// Granule a storage node's segment is carved at (each part starts on a page).
const PART_ALIGN: u64 = 4096;

/// FNV-1a 64 of `key`.
pub fn fnv1a64(key: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    key.iter()
        .fold(OFFSET, |h, &b| (h ^ b as u64).wrapping_mul(PRIME))
}

/// MurmurHash3's 64-bit finalizer: every output bit depends on every input bit.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The shard that owns `key` among `shards` (at least 1):
/// `fmix64(fnv1a64(key)) % shards`.
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    if shards <= 1 {
        return 0;
    }
    (fmix64(fnv1a64(key)) % shards as u64) as usize
}

/// The indices of `keys` grouped by shard: `(shard, indices in the caller's order)` for
/// each shard that owns at least one key, by ascending shard.
pub(crate) fn split<K: AsRef<[u8]>>(keys: &[K], shards: usize) -> Vec<(usize, Vec<usize>)> {
    let mut by: Vec<Vec<usize>> = vec![Vec::new(); shards.max(1)];
    for (i, k) in keys.iter().enumerate() {
        by[shard_of(k.as_ref(), shards)].push(i);
    }
    by.into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .collect()
}

/// Puts per-group results back in the caller's order: `results[g][j]` is the result of
/// key `groups[g].1[j]`. Each group's results must be as many as its indices (the
/// per-shard calls answer one per key), and the groups must cover `0..n` once.
pub(crate) fn merge<T>(n: usize, groups: &[(usize, Vec<usize>)], results: Vec<Vec<T>>) -> Vec<T> {
    let mut out: Vec<Option<T>> = std::iter::repeat_with(|| None).take(n).collect();
    for ((_, idx), res) in groups.iter().zip(results) {
        assert_eq!(idx.len(), res.len(), "one result per key of a shard");
        for (&i, r) in idx.iter().zip(res) {
            out[i] = Some(r);
        }
    }
    out.into_iter()
        .map(|r| r.expect("the groups cover every key"))
        .collect()
}

/// [`merge`] of per-shard calls that may have failed: a failed shard gives each of its
/// keys `failed(code)` (the error's per-key code) and the other shards' keys keep their
/// answers. The whole fails only when every shard failed (with the first one's error), as
/// a call to one master would.
pub(crate) fn merge_results<T>(
    n: usize,
    groups: &[(usize, Vec<usize>)],
    results: Vec<Result<Vec<T>>>,
    failed: impl Fn(Code) -> T,
) -> Result<Vec<T>> {
    if results.iter().all(Result::is_err) {
        return match results.into_iter().next() {
            Some(Err(e)) => Err(e),
            _ => Ok(Vec::new()),
        };
    }
    let answers = results
        .into_iter()
        .zip(groups)
        .map(|(r, (shard, idx))| match r {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(shard, keys = idx.len(), "store: shard failed its keys: {e}");
                let code = e.code();
                idx.iter().map(|_| failed(code)).collect()
            }
        })
        .collect();
    Ok(merge(n, groups, answers))
}

/// Runs the jobs at once, the first on the calling thread and each other one on a scoped
/// thread of its own (so at most one thread per shard per call, all joined before this
/// returns); a job whose thread cannot be spawned runs on the calling thread.
pub(crate) fn concurrently<T: Send, F: FnOnce() -> T + Send>(jobs: Vec<F>) -> Vec<T> {
    // Each job sits in a slot the caller takes it back from if its thread did not start.
    let slots: Vec<Mutex<Option<F>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let run = |slot: &Mutex<Option<F>>| {
        let job = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        job.map(|j| j())
    };
    let Some((first, rest)) = slots.split_first() else {
        return Vec::new();
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = rest
            .iter()
            .map(|slot| {
                std::thread::Builder::new()
                    .name("pagewire-store-shard".into())
                    .spawn_scoped(s, move || run(slot))
                    .ok()
            })
            .collect();
        let mut out = Vec::with_capacity(slots.len());
        out.extend(run(first));
        for (h, slot) in handles.into_iter().zip(rest) {
            let done = match h.map(|h| h.join()) {
                Some(Ok(r)) => r,
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                None => None,
            };
            out.extend(done.or_else(|| run(slot)));
        }
        out
    })
}

/// The sizes of the parts a storage node's segment of `size` bytes is carved into for
/// `shards` shards: equal parts rounded down to 4 KiB, the last one taking the rest.
pub(crate) fn carve(size: u64, shards: usize) -> Result<Vec<u64>> {
    let n = shards.max(1) as u64;
    if n == 1 {
        return Ok(vec![size]);
    }
    let part = size / n / PART_ALIGN * PART_ALIGN;
    if part == 0 {
        return Err(StoreError::invalid(format!(
            "a segment of {size} bytes cannot be carved into {n} parts of at least \
             {PART_ALIGN} bytes (one per shard)"
        )));
    }
    let mut v = vec![part; n as usize - 1];
    v.push(size - part * (n - 1));
    Ok(v)
}

/// The counts of all shards: sums (a client or a storage node known to every shard is
/// counted once per shard).
pub(crate) fn sum_stats(all: impl IntoIterator<Item = Stats>) -> Stats {
    all.into_iter().fold(Stats::default(), |a, b| Stats {
        clients: a.clients + b.clients,
        segments: a.segments + b.segments,
        objects: a.objects + b.objects,
        pending: a.pending + b.pending,
        capacity: a.capacity + b.capacity,
        used: a.used + b.used,
        evicted: a.evicted + b.evicted,
        reclaimed: a.reclaimed + b.reclaimed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The hash is the cluster's routing: these values must never change.
    #[test]
    fn hash_values_are_pinned() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fmix64(fnv1a64(b"")), 0xefd0_1f60_ba99_2926);
        assert_eq!(fmix64(fnv1a64(b"a")), 0x82a2_a958_a9be_ce5b);
        assert_eq!(fmix64(fnv1a64(b"foobar")), 0x2c22_1949_22d1_672b);
        let keys: [&[u8]; 6] = [b"a", b"b", b"key-0", b"key-1", b"h0_0_k", b"foobar"];
        let on = |n| keys.iter().map(|k| shard_of(k, n)).collect::<Vec<_>>();
        assert_eq!(on(2), [1, 0, 1, 0, 1, 1]);
        assert_eq!(on(3), [2, 1, 0, 0, 0, 1]);
        assert_eq!(on(1), [0; 6]);
        assert_eq!(shard_of(b"anything", 0), 0);
    }

    #[test]
    fn carving() {
        assert_eq!(carve(1 << 20, 1).unwrap(), [1 << 20]);
        assert_eq!(carve(1 << 20, 2).unwrap(), [512 << 10, 512 << 10]);
        assert_eq!(carve(10_000, 2).unwrap(), [4096, 10_000 - 4096]);
        assert_eq!(carve(3 << 20, 3).unwrap().iter().sum::<u64>(), 3 << 20);
        assert!(carve(8191, 2).is_err());
    }

    #[test]
    fn jobs_run_concurrently_in_order() {
        let barrier = std::sync::Barrier::new(3);
        let jobs: Vec<_> = (0..3)
            .map(|i| {
                let b = &barrier;
                move || {
                    // Deadlocks unless all three run at once.
                    b.wait();
                    i * 10
                }
            })
            .collect();
        assert_eq!(concurrently(jobs), [0, 10, 20]);
        assert!(concurrently(Vec::<fn() -> u8>::new()).is_empty());
    }

    #[test]
    fn stats_add_up() {
        let s = Stats {
            objects: 3,
            capacity: 10,
            ..Stats::default()
        };
        let t = sum_stats([s, s]);
        assert_eq!((t.objects, t.capacity, t.used), (6, 20, 0));
    }

    proptest! {
        /// Splitting a batch by shard, running a per-key function on each shard's share
        /// and merging gives what the function gives over the whole batch, and every
        /// share holds only its shard's keys, in the caller's order.
        #[test]
        fn split_merge_matches_brute_force(
            keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..64),
            shards in 1usize..9,
        ) {
            let groups = split(&keys, shards);
            let mut seen = vec![0u32; keys.len()];
            let mut last_shard = None;
            for (s, idx) in &groups {
                prop_assert!(*s < shards);
                prop_assert!(last_shard < Some(*s), "ascending, each shard once");
                last_shard = Some(*s);
                prop_assert!(!idx.is_empty());
                prop_assert!(idx.windows(2).all(|w| w[0] < w[1]), "caller's order");
                for &i in idx {
                    prop_assert_eq!(shard_of(&keys[i], shards), *s);
                    seen[i] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
            let f = |k: &Vec<u8>| (k.len(), k.iter().map(|&b| b as u64).sum::<u64>());
            let results: Vec<Vec<_>> = groups
                .iter()
                .map(|(_, idx)| idx.iter().map(|&i| f(&keys[i])).collect())
                .collect();
            let merged = merge(keys.len(), &groups, results);
            let brute: Vec<_> = keys.iter().map(f).collect();
            prop_assert_eq!(merged, brute);
        }

        /// With some shards failed: their keys get the error's code, the others their
        /// answer; only when all failed is the whole call an error.
        #[test]
        fn failed_shards_fail_only_their_keys(
            keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..8), 1..48),
            shards in 2usize..6,
            down in proptest::collection::vec(any::<bool>(), 6),
        ) {
            let groups = split(&keys, shards);
            let results: Vec<Result<Vec<Result<usize, Code>>>> = groups
                .iter()
                .map(|(s, idx)| {
                    if down[*s] {
                        Err(StoreError::Timeout { what: "test", after: Default::default() })
                    } else {
                        Ok(idx.iter().map(|&i| Ok(keys[i].len())).collect())
                    }
                })
                .collect();
            let got = merge_results(keys.len(), &groups, results, Err);
            let all_down = groups.iter().all(|(s, _)| down[*s]);
            match got {
                Err(e) => prop_assert!(all_down && e.code() == Code::Timeout),
                Ok(v) => {
                    prop_assert!(!all_down);
                    let brute: Vec<Result<usize, Code>> = keys
                        .iter()
                        .map(|k| {
                            if down[shard_of(k, shards)] { Err(Code::Timeout) } else { Ok(k.len()) }
                        })
                        .collect();
                    prop_assert_eq!(v, brute);
                }
            }
        }
    }
}
