//! The caller-side wait policy as data: how long a waiter spins, when it yields, when it
//! reads the clock, and the nap schedule once it must reap with pauses. The loops that
//! execute these steps (spin, `sched_yield`, sleep) live in the engine (`engine::wait`);
//! what a waiter drives, a [`Reaper`], is defined here so that a batch can carry one.

use std::fmt;
use std::time::Duration;

/// Completions a waiting thread can reap itself. A caller that busy-polls through this
/// sees its completion or notification without a hand-off from the backend's completion
/// thread (a futex wake-up per batch), and that thread steps aside meanwhile, so one
/// core, not two, spins per waiter: what a perftest-style loop does.
pub(crate) trait Reaper: Send + Sync + fmt::Debug {
    /// Reaps completions once on the calling thread; returns how many were handled (0 also
    /// when another thread is reaping at this moment).
    fn poll_once(&self) -> usize;
    /// A caller starts (`true`) or stops (`false`) busy-polling.
    fn set_waiting(&self, on: bool);
    /// How long a waiter busy-polls while nothing completes before it blocks instead.
    fn spin_budget(&self) -> Duration;
    /// No completion thread ([`crate::ProgressMode::Manual`]): a waiter past its spin
    /// budget must keep reaping (with naps) instead of blocking on what that thread
    /// would have signalled.
    fn callers_only(&self) -> bool {
        false
    }
}

/// How often an idle busy-poll gives the CPU away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Yield {
    /// Every idle round after the first few: for waits on our own WRs, whose completion
    /// is kernel work (soft-RoCE's tasklets and softirqs) that may need this very CPU; a
    /// spinner that yields rarely halves large-message bandwidth on small hosts.
    Often,
    /// Every [`BUSY_YIELD_RARELY`] idle rounds: for waits on the peer (a notification).
    /// Each `sched_yield` may switch tasks, which costs tens of microseconds on small
    /// virtual machines; a receiver spins like perftest's memory poll, and the kernel still
    /// preempts it when another task must run.
    Rarely,
}

/// Idle busy-poll rounds that only spin before yielding starts.
pub(crate) const BUSY_SPIN_ROUNDS: u32 = 16;
/// Idle rounds between two yields under [`Yield::Rarely`].
pub(crate) const BUSY_YIELD_RARELY: u32 = 128;
/// Idle rounds between two clock reads (deadline and spin budget checks).
pub(crate) const BUSY_CLOCK_EVERY: u32 = 8;

/// First pause of a wait that reaps with naps ([`Reaper::callers_only`]).
pub(crate) const NAP_FIRST: Duration = Duration::from_micros(50);
/// Longest pause of such a wait; each pause doubles up to it.
pub(crate) const NAP_MAX: Duration = Duration::from_millis(1);

/// The pause after `nap`: doubled, at most [`NAP_MAX`].
pub(crate) fn next_nap(nap: Duration) -> Duration {
    (nap * 2).min(NAP_MAX)
}

/// Verbs, a thread waiting on one connection: every this many reaping rounds it reaps the
/// whole engine's connections too.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) const ENGINE_REAP_EVERY: u32 = 64;

/// Verbs completion thread: idle rounds that only spin (`spin_loop`) before the hot loop yields the CPU every round.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) const SPIN_ROUNDS: u32 = 16;

/// How long the completion thread first naps while callers reap completions themselves;
/// each further nap in a row doubles, up to [`CALLER_NAP_MAX`].
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) const CALLER_NAP: Duration = Duration::from_millis(2);

/// The longest such nap. Each wake-up preempts a spinning caller on a small host (the 99th
/// percentile of a ping-pong on 2 vCPUs fell from about 420 to 160 us with 50 ms naps
/// instead of 2 ms). While callers reap they also reap the whole engine regularly, so
/// what a longer nap delays is only work that completes after the last caller stopped,
/// by at most this long.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) const CALLER_NAP_MAX: Duration = Duration::from_millis(16);

/// The completion thread's next nap while callers reap: doubled, at most
/// [`CALLER_NAP_MAX`].
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) fn next_caller_nap(nap: Duration) -> Duration {
    (nap * 2).min(CALLER_NAP_MAX)
}

/// The completion thread's nap when nothing is outstanding, after `naps` naps in a row:
/// 50 us doubling to 1 ms (a post wakes it earlier).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
pub(crate) fn idle_nap(naps: u32) -> Duration {
    (NAP_FIRST * (1 << naps.min(5))).min(NAP_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nap_schedules() {
        assert_eq!(idle_nap(0), Duration::from_micros(50));
        assert_eq!(idle_nap(1), Duration::from_micros(100));
        assert_eq!(idle_nap(4), Duration::from_micros(800));
        assert_eq!(idle_nap(9), Duration::from_millis(1));
        assert_eq!(
            next_nap(Duration::from_micros(800)),
            Duration::from_millis(1)
        );
        assert_eq!(next_caller_nap(CALLER_NAP), Duration::from_millis(4));
        assert_eq!(next_caller_nap(CALLER_NAP_MAX), CALLER_NAP_MAX);
    }
}
