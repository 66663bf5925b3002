//! perftest's arithmetic: bandwidth peak/average/message rate from post and completion
//! timestamps, and the latency percentiles of `*_lat`.
//!
//! Timestamps are nanoseconds on one monotonic clock (`Instant`), not TSC cycles, so
//! there is no CPU-frequency estimate to get wrong.

/// perftest's MiB.
pub const MIB: f64 = (1u64 << 20) as f64;
/// perftest drops this many of the largest latency samples before avg/median/stdev.
pub const LAT_MEASURE_TAIL: usize = 2;

/// Timestamps of one bandwidth run: `posted[i]` when op `i` was handed to the engine,
/// `completed[i]` when its completion was seen. One completion stands for a whole batch
/// of `cq_mod` ops, so every op of a batch gets the batch's time (as perftest fills the
/// window of one moderated CQE).
#[derive(Debug, Clone, Default)]
pub struct BwSamples {
    pub posted: Vec<u64>,
    pub completed: Vec<u64>,
}

/// One result row of a bandwidth test, in bytes per second.
// Deserialize: the same struct is the side-channel record, checked on receipt
// (`oob::checked_bw` / `oob::checked_lat`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BwResult {
    pub bytes: u64,
    pub iterations: u64,
    /// None when the peak was not measured (duration mode, `-N`, > 20000 iterations).
    pub peak_bps: Option<f64>,
    pub avg_bps: f64,
    pub msg_rate_mpps: f64,
}

impl BwResult {
    /// Sum of two ends' results (bidirectional: each side measures what it initiates).
    pub fn sum(&self, other: &BwResult) -> BwResult {
        BwResult {
            bytes: self.bytes,
            iterations: self.iterations,
            peak_bps: match (self.peak_bps, other.peak_bps) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
            avg_bps: self.avg_bps + other.avg_bps,
            msg_rate_mpps: self.msg_rate_mpps + other.msg_rate_mpps,
        }
    }
}

/// perftest's `print_report_bw` arithmetic.
///
/// * average = size * ops / (completed[last] - posted[0])
/// * msg rate = ops / same time / 10^6
/// * peak = size / min over windows [i, j] of (completed[j] - posted[i]) / (j - i + 1),
///   with i stepping by `post_list` and j on CQ-moderation boundaries plus the last op.
///
/// `iterations` is what the row prints (per QP, like perftest); `samples` holds every
/// op of every QP.
pub fn bw_result(
    size: u64,
    iterations: u64,
    samples: &BwSamples,
    cq_mod: usize,
    post_list: usize,
    peak: bool,
) -> BwResult {
    let n = samples.posted.len().min(samples.completed.len());
    if n == 0 {
        return BwResult {
            bytes: size,
            iterations,
            peak_bps: peak.then_some(0.0),
            avg_bps: 0.0,
            msg_rate_mpps: 0.0,
        };
    }
    let span_ns = samples.completed[n - 1]
        .saturating_sub(samples.posted[0])
        .max(1) as f64;
    let secs = span_ns / 1e9;
    let avg_bps = (size as f64 * n as f64) / secs;
    let msg_rate_mpps = n as f64 / secs / 1e6;
    let peak_bps = peak.then(|| {
        let min_ns = min_window_ns(
            &samples.posted[..n],
            &samples.completed[..n],
            cq_mod.max(1),
            post_list.max(1),
        );
        size as f64 / (min_ns.max(1.0) / 1e9)
    });
    BwResult {
        bytes: size,
        iterations,
        peak_bps,
        avg_bps,
        msg_rate_mpps,
    }
}

fn min_window_ns(posted: &[u64], completed: &[u64], cq_mod: usize, post_list: usize) -> f64 {
    let n = posted.len();
    let mut best = f64::INFINITY;
    let mut consider = |i: usize, j: usize| {
        let t = completed[j].saturating_sub(posted[i]) as f64 / (j - i + 1) as f64;
        if t < best {
            best = t;
        }
    };
    for i in (0..n).step_by(post_list) {
        // First completion boundary at or after i: round i+1 up to a multiple of cq_mod.
        let mut j = (i + 1).div_ceil(cq_mod) * cq_mod - 1;
        while j < n {
            consider(i, j);
            j += cq_mod;
        }
        if !n.is_multiple_of(cq_mod) {
            consider(i, n - 1);
        }
    }
    best
}

/// In duration mode perftest counts only what completes inside `[margin, D - margin]`.
/// Returns the sub-slice of ops posted at or after `start` and completed by `end`.
pub fn trim_window(samples: &BwSamples, start_ns: u64, end_ns: u64) -> BwSamples {
    let n = samples.posted.len().min(samples.completed.len());
    let first = samples.posted[..n].partition_point(|&t| t < start_ns);
    let last = samples.completed[..n].partition_point(|&t| t <= end_ns);
    if last <= first {
        return BwSamples::default();
    }
    BwSamples {
        posted: samples.posted[first..last].to_vec(),
        completed: samples.completed[first..last].to_vec(),
    }
}

/// One result row of a latency test, microseconds.
// Deserialize: the same struct is the side-channel record, checked on receipt
// (`oob::checked_bw` / `oob::checked_lat`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatResult {
    pub bytes: u64,
    pub iterations: u64,
    pub t_min_us: f64,
    pub t_max_us: f64,
    pub t_typical_us: f64,
    pub t_avg_us: f64,
    pub t_stdev_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// perftest's `print_report_lat` arithmetic on post timestamps of a ping-pong:
/// samples are `posted[i+1] - posted[i]` divided by `rtt_factor` (2 for write:
/// a half round trip), sorted; the two largest are dropped for median/avg/stdev;
/// `t_max` is the element just past the kept set; 99% and 99.9% are the sorted
/// elements at `ceil(kept * p)`. Unlike perftest the stdev is computed in floating
/// point (perftest truncates each deviation to whole microseconds).
pub fn lat_result(size: u64, iterations: u64, posted_ns: &[u64], rtt_factor: f64) -> LatResult {
    let mut d: Vec<f64> = posted_ns
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]) as f64 / 1e3 / rtt_factor)
        .collect();
    lat_from_samples(size, iterations, &mut d)
}

/// As [`lat_result`], from samples already in microseconds.
pub fn lat_from_samples(size: u64, iterations: u64, d: &mut [f64]) -> LatResult {
    d.sort_by(f64::total_cmp);
    let zero = LatResult {
        bytes: size,
        iterations,
        t_min_us: 0.0,
        t_max_us: 0.0,
        t_typical_us: 0.0,
        t_avg_us: 0.0,
        t_stdev_us: 0.0,
        p99_us: 0.0,
        p999_us: 0.0,
    };
    if d.is_empty() {
        return zero;
    }
    // Keep at least one sample when there are fewer than three.
    let kept = d.len().saturating_sub(LAT_MEASURE_TAIL).max(1);
    let set = &d[..kept];
    let median = if kept.is_multiple_of(2) {
        (set[kept / 2] + set[kept / 2 - 1]) / 2.0
    } else {
        set[kept / 2]
    };
    let avg = set.iter().sum::<f64>() / kept as f64;
    let var = set.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / kept as f64;
    let at = |idx: usize| d[idx.min(d.len() - 1)];
    LatResult {
        bytes: size,
        iterations,
        t_min_us: d[0],
        t_max_us: at(kept),
        t_typical_us: median,
        t_avg_us: avg,
        t_stdev_us: var.sqrt(),
        p99_us: at((kept as f64 * 0.99 - 1e-9).ceil() as usize),
        p999_us: at((kept as f64 * 0.999 - 1e-9).ceil() as usize),
    }
}

/// Percentile of sorted samples (nearest rank), for the page benchmark's batch latencies.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // The epsilon keeps 99.9% of 1000 at rank 999 despite 0.999 * 1000 = 999.0000000000001.
    let rank = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn average_is_bytes_over_first_post_to_last_completion() {
        // 4 ops of 1 MiB, posted at 0,1,2,3 ms, completed at 1,2,3,4 ms: 4 MiB in 4 ms.
        let s = BwSamples {
            posted: vec![0, 1_000_000, 2_000_000, 3_000_000],
            completed: vec![1_000_000, 2_000_000, 3_000_000, 4_000_000],
        };
        let r = bw_result(1 << 20, 4, &s, 1, 1, true);
        assert!((r.avg_bps / MIB - 1000.0).abs() < 1e-9);
        assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
        // Every window is 1 ms per message: peak equals average here.
        assert!((r.peak_bps.unwrap() / MIB - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn peak_finds_the_fastest_window() {
        // First op slow (10 ms), the next three 1 ms each.
        let s = BwSamples {
            posted: vec![0, 10_000_000, 11_000_000, 12_000_000],
            completed: vec![10_000_000, 11_000_000, 12_000_000, 13_000_000],
        };
        let r = bw_result(1000, 4, &s, 1, 1, true);
        assert!((r.peak_bps.unwrap() - 1000.0 / 1e-3).abs() < 1e-6);
        assert!(r.avg_bps < r.peak_bps.unwrap());
        assert_eq!(bw_result(1000, 4, &s, 1, 1, false).peak_bps, None);
    }

    /// The brute force perftest loop, straight from its definition.
    fn brute_min(p: &[u64], c: &[u64], cq: usize, pl: usize) -> f64 {
        let n = p.len();
        let mut best = f64::INFINITY;
        let mut i = 0;
        while i < n {
            for (j, &cj) in c.iter().enumerate().skip(i) {
                if (j + 1) % cq == 0 || j == n - 1 {
                    best = best.min(cj.saturating_sub(p[i]) as f64 / (j - i + 1) as f64);
                }
            }
            i += pl;
        }
        best
    }

    proptest! {
        #[test]
        fn peak_window_matches_brute_force(
            gaps in proptest::collection::vec(1u64..1000, 1..60),
            lat in proptest::collection::vec(1u64..5000, 1..60),
            cq in 1usize..9, pl in 1usize..5,
        ) {
            let n = gaps.len().min(lat.len());
            let mut posted = Vec::with_capacity(n);
            let mut t = 0;
            for g in &gaps[..n] { t += g; posted.push(t); }
            // Completions in order and never before the post.
            let mut completed = Vec::with_capacity(n);
            let mut last = 0;
            for i in 0..n { last = last.max(posted[i] + lat[i]); completed.push(last); }
            let fast = min_window_ns(&posted, &completed, cq, pl);
            let slow = brute_min(&posted, &completed, cq, pl);
            prop_assert!((fast - slow).abs() < 1e-9, "{fast} vs {slow}");
        }
    }

    #[test]
    fn latency_matches_perftest_definitions() {
        // Round trips 2,4,...,24 us: 12 posts -> 11 samples of 2*k us, halved -> k us
        // for k = 1..=11 (one sample each).
        let mut posted = vec![0u64];
        for k in 1..=11u64 {
            posted.push(posted.last().unwrap() + 2_000 * k);
        }
        let r = lat_result(2, 12, &posted, 2.0);
        assert_eq!(r.t_min_us, 1.0);
        // Kept set = 1..=9 (two largest dropped); t_max = element past it = 10.
        assert_eq!(r.t_max_us, 10.0);
        assert_eq!(r.t_typical_us, 5.0);
        assert_eq!(r.t_avg_us, 5.0);
        assert!((r.t_stdev_us - (60.0f64 / 9.0).sqrt()).abs() < 1e-12);
        // ceil(9 * 0.99) = 9 -> sorted[9] = 10; same for 99.9%.
        assert_eq!(r.p99_us, 10.0);
        assert_eq!(r.p999_us, 10.0);
    }

    #[test]
    fn duration_window_keeps_only_the_middle() {
        let s = BwSamples {
            posted: (0..10).map(|i| i * 100).collect(),
            completed: (0..10).map(|i| i * 100 + 50).collect(),
        };
        let w = trim_window(&s, 200, 750);
        assert_eq!(w.posted, vec![200, 300, 400, 500, 600, 700]);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 500.0);
        assert_eq!(percentile(&v, 99.0), 990.0);
        assert_eq!(percentile(&v, 99.9), 999.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
