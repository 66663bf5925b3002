//! The caller's handle to a submitted batch: status, cancel, and `wait`, which reaps on
//! the caller's thread (verbs), reads the batch's responses itself (TCP, small batches),
//! or blocks on the batch's condition variable.

use std::sync::Arc;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::core::batch::{BatchShared, BatchStats, BatchStatus, Phase};
use crate::core::wait::Yield;
use crate::engine::wait::{busy_poll, poll_with_naps};
use crate::error::{Error, Result};
use crate::types::PeerId;

/// Handle to a submitted batch. Dropping it does not cancel the batch.
#[derive(Debug, Clone)]
pub struct TransferHandle {
    shared: Arc<BatchShared>,
}

impl TransferHandle {
    pub(crate) fn new(shared: Arc<BatchShared>) -> Self {
        TransferHandle { shared }
    }
}

impl TransferHandle {
    /// Engine-wide batch id.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The peer.
    pub fn peer(&self) -> PeerId {
        self.shared.peer
    }

    /// The batch deadline.
    pub fn deadline(&self) -> Instant {
        self.shared.deadline
    }

    /// Current status (non-blocking). A pending batch whose deadline passed becomes
    /// `Failed(Timeout)` here.
    pub fn status(&self) -> BatchStatus {
        // No reaping here: a status check between posts should stay cheap, and the
        // completion thread reaps while nobody waits.
        self.shared.status(Instant::now())
    }

    /// Bytes completed so far (a lower bound while pending).
    pub fn bytes_done(&self) -> u64 {
        self.shared.done_bytes.load(Ordering::Acquire)
    }

    /// Blocks until the batch finishes or `deadline` passes, whichever is first.
    ///
    /// Returns the stats on success; the batch error, `Cancelled`, or
    /// `Timeout` (wait deadline passed, batch still running) otherwise.
    ///
    /// On verbs the calling thread first busy-polls the completion queues itself (for up
    /// to the engine's `poll_spin` without any completion), then blocks. On TCP, for a
    /// small batch sent on an idle stream, it blocks reading the batch's responses from
    /// that stream itself (unless the stream's receiver thread is reading right then).
    pub fn wait(&self, deadline: Instant) -> Result<BatchStats> {
        let s = &self.shared;
        let started = Instant::now();
        if let Some(d) = &s.driver {
            let until = deadline.min(s.deadline);
            let finished = || s.finished.load(Ordering::Acquire).then_some(());
            if busy_poll(&**d, until, Yield::Often, finished).is_none() && d.callers_only() {
                // No completion thread would wake the sleep below: keep reaping.
                poll_with_naps(&**d, until, finished);
            }
        }
        if let Some(r) = s.reader.get().and_then(Weak::upgrade)
            && !s.finished.load(Ordering::Acquire)
        {
            r.read_until(
                &|| s.finished.load(Ordering::Acquire),
                deadline.min(s.deadline),
            );
        }
        let mut p = s.lock();
        loop {
            match &*p {
                Phase::Pending => {}
                Phase::Done(elapsed) => {
                    return Ok(BatchStats {
                        ops: s.ops,
                        slices: s.slices,
                        bytes: s.done_bytes.load(Ordering::Acquire).max(s.bytes),
                        elapsed: *elapsed,
                    });
                }
                Phase::Failed(e) => return Err(e.clone()),
                Phase::Cancelled => return Err(Error::Cancelled),
            }
            let now = Instant::now();
            if now >= s.deadline {
                drop(p);
                s.expire_if_due(now);
                p = s.lock();
                continue;
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    after: now - started,
                });
            }
            let until = deadline.min(s.deadline);
            s.sleepers.fetch_add(1, Ordering::AcqRel);
            p =
                s.cv.wait_timeout(p, until - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            s.sleepers.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// `wait` with a relative timeout.
    pub fn wait_timeout(&self, d: Duration) -> Result<BatchStats> {
        self.wait(Instant::now() + d)
    }

    /// Requests cancellation. Returns `true` if the batch was still pending (it is now
    /// `Cancelled`), `false` if it had already finished.
    ///
    /// Returns once nothing of the batch can touch its local memory any more, within a
    /// short bound: on TCP and loopback at once; on verbs once its work requests have
    /// completed (up to 50 ms), or else flushed after its connection was broken for them
    /// (up to 50 ms more; the connection is set up again as after any break). Its regions
    /// may be deregistered right after, unless the backend could not stop it in time.
    pub fn cancel(&self) -> bool {
        self.shared.cancel()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::batch::{BatchState, Pins};
    use crate::types::PeerId;

    fn state(deadline: Duration) -> BatchState {
        let now = Instant::now();
        BatchState::new(
            1,
            PeerId(1),
            1,
            1,
            10,
            now,
            now + deadline,
            Pins::new(),
            None,
        )
    }

    #[test]
    fn first_outcome_wins() {
        let b = state(Duration::from_secs(10));
        let h = TransferHandle::new(b.shared());
        assert!(matches!(h.status(), BatchStatus::Pending));
        b.add_progress(1, 10);
        b.succeed(Instant::now());
        b.fail(Error::Cancelled);
        assert!(matches!(h.status(), BatchStatus::Done));
        let st = h.wait(Instant::now()).unwrap();
        assert_eq!(st.bytes, 10);
        assert!(!h.cancel());
    }

    #[test]
    fn deadline_fails_the_batch_even_if_backend_is_silent() {
        let b = state(Duration::from_millis(20));
        let h = TransferHandle::new(b.shared());
        let t0 = Instant::now();
        let e = h.wait(Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(b.should_stop(Instant::now()));
    }

    #[test]
    fn wait_deadline_does_not_fail_the_batch() {
        let b = state(Duration::from_secs(10));
        let h = TransferHandle::new(b.shared());
        let e = h
            .wait(Instant::now() + Duration::from_millis(10))
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }));
        assert!(matches!(h.status(), BatchStatus::Pending));
        assert!(h.cancel());
        assert!(b.should_stop(Instant::now()));
        assert!(matches!(h.wait(Instant::now()), Err(Error::Cancelled)));
    }

    #[test]
    fn nothing_lands_after_a_reported_failure() {
        let b = Arc::new(state(Duration::from_secs(10)));
        let h = TransferHandle::new(b.shared());
        let g = b.landing().expect("pending: bytes may land");
        // A failure waits for the bytes being landed.
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.fail(Error::Cancelled));
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(h.status(), BatchStatus::Pending));
        drop(g);
        t.join().unwrap();
        assert!(matches!(h.status(), BatchStatus::Failed(_)));
        // And no more landing is allowed after it.
        assert!(b.landing().is_none());
        let c = state(Duration::from_secs(10));
        assert!(TransferHandle::new(c.shared()).cancel());
        assert!(c.landing().is_none());
    }

    #[test]
    fn waiter_is_woken() {
        let b = Arc::new(state(Duration::from_secs(10)));
        let h = TransferHandle::new(b.shared());
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b2.succeed(Instant::now());
        });
        h.wait(Instant::now() + Duration::from_secs(5)).unwrap();
        t.join().unwrap();
    }
}
