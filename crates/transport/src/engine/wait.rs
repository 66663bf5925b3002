//! The loops that execute the wait policy of `core::wait`: busy-poll a [`Reaper`] (spin,
//! then yield), then reap with growing naps. The only place a caller's thread spins,
//! yields or sleeps while it waits for completions.

#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use crate::core::wait::{
    BUSY_CLOCK_EVERY, BUSY_SPIN_ROUNDS, BUSY_YIELD_RARELY, NAP_FIRST, Reaper, Yield, next_nap,
};

/// Busy-polls `p` until `ready` yields a value, `deadline` passes, or nothing completed
/// for [`Reaper::spin_budget`]; `None` in the last two cases (the caller then blocks).
pub(crate) fn busy_poll<T>(
    p: &dyn Reaper,
    deadline: Instant,
    policy: Yield,
    ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    busy_poll_since(p, deadline, policy, ready).ok()
}

/// [`busy_poll`], telling on `Err` when it first read the clock (a few idle rounds after
/// it began; `None` if it never did), for callers that report how long they waited.
pub(crate) fn busy_poll_since<T>(
    p: &dyn Reaper,
    deadline: Instant,
    policy: Yield,
    mut ready: impl FnMut() -> Option<T>,
) -> std::result::Result<T, Option<Instant>> {
    struct Waiting<'a>(&'a dyn Reaper);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.set_waiting(false);
        }
    }
    if let Some(v) = ready() {
        return Ok(v);
    }
    // One round often settles it (a small WRITE's completion is in the CQ by the time its
    // poster waits: rxe runs it inside the post's system call), so the first goes
    // without the waiter count and the spin budget.
    p.poll_once();
    if let Some(v) = ready() {
        return Ok(v);
    }
    p.set_waiting(true);
    let _waiting = Waiting(p);
    let budget = p.spin_budget();
    // When the idle stretch began, read at its first clock check rather than at every
    // completion: a wait that ends within a few rounds reads no clock at all.
    let mut last: Option<Instant> = None;
    let mut first: Option<Instant> = None;
    let mut idle: u32 = 0;
    loop {
        let n = p.poll_once();
        if let Some(v) = ready() {
            return Ok(v);
        }
        if n > 0 {
            idle = 0;
            last = None;
            continue;
        }
        idle = idle.saturating_add(1);
        let give_away = idle >= BUSY_SPIN_ROUNDS
            && match policy {
                Yield::Often => true,
                Yield::Rarely => idle.is_multiple_of(BUSY_YIELD_RARELY),
            };
        if give_away {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        if idle.is_multiple_of(BUSY_CLOCK_EVERY) {
            let now = Instant::now();
            first.get_or_insert(now);
            let since = *last.get_or_insert(now);
            if now >= deadline || now.duration_since(since) >= budget {
                return Err(first);
            }
        }
    }
}

/// Reaps through `p` every 50 us, doubling to 1 ms, until `ready` yields a value or
/// `deadline` passes (`None`): the slow phase of a wait that must reap for itself.
pub(crate) fn poll_with_naps<T>(
    p: &dyn Reaper,
    deadline: Instant,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut nap = NAP_FIRST;
    loop {
        p.poll_once();
        if let Some(v) = ready() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = next_nap(nap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

    /// Completes "work" after `after` polls; records the waiting balance.
    #[derive(Debug, Default)]
    struct Fake {
        polls: AtomicUsize,
        after: usize,
        waiting: AtomicIsize,
        max_waiting: AtomicIsize,
        budget_ms: u64,
    }

    impl Reaper for Fake {
        fn poll_once(&self) -> usize {
            let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            usize::from(n == self.after)
        }
        fn set_waiting(&self, on: bool) {
            let w = self
                .waiting
                .fetch_add(if on { 1 } else { -1 }, Ordering::SeqCst);
            if on {
                self.max_waiting.fetch_max(w + 1, Ordering::SeqCst);
            }
        }
        fn spin_budget(&self) -> Duration {
            Duration::from_millis(self.budget_ms)
        }
    }

    #[test]
    fn busy_poll_returns_once_ready_and_balances_waiting() {
        let f = Fake {
            after: 100,
            budget_ms: 1000,
            ..Fake::default()
        };
        let got = busy_poll(
            &f,
            Instant::now() + Duration::from_secs(5),
            Yield::Often,
            || (f.polls.load(Ordering::SeqCst) >= f.after).then_some(7),
        );
        assert_eq!(got, Some(7));
        assert_eq!(f.polls.load(Ordering::SeqCst), 100);
        assert_eq!(f.waiting.load(Ordering::SeqCst), 0);
        assert_eq!(f.max_waiting.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn busy_poll_ready_at_once_does_not_poll() {
        let f = Fake::default();
        assert_eq!(
            busy_poll(&f, Instant::now(), Yield::Rarely, || Some(1)),
            Some(1)
        );
        assert_eq!(f.polls.load(Ordering::SeqCst), 0);
        assert_eq!(f.max_waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn busy_poll_gives_up_at_the_deadline_or_after_the_idle_budget() {
        // Nothing ever completes. (deadline, idle budget, what ends it): the deadline, or,
        // with a far deadline, the idle budget (the caller then blocks instead).
        for (deadline_ms, budget_ms, ends_ms) in [(30, 60_000, 30), (60_000, 20, 20)] {
            let f = Fake {
                after: usize::MAX,
                budget_ms,
                ..Fake::default()
            };
            let t = Instant::now();
            let got: Option<()> = busy_poll(
                &f,
                t + Duration::from_millis(deadline_ms),
                Yield::Rarely,
                || None,
            );
            assert!(got.is_none());
            assert!(t.elapsed() >= Duration::from_millis(ends_ms));
            assert!(t.elapsed() < Duration::from_secs(10));
            assert_eq!(f.waiting.load(Ordering::SeqCst), 0);
        }
    }
}
