//! Connection health as verdicts: given what a connection's QP has outstanding and how
//! long it made no progress, whether it is stalled (a dead peer), needs a heartbeat, or is
//! fine. Pure functions of (state, elapsed time); the caller reads the clock and acts.

use std::sync::OnceLock;
use std::time::Duration;

/// A QP with WRs outstanding and no progress for this long counts as a dead peer.
/// Hardware reports a dead peer itself (RETRY_EXC_ERR after `(retry_cnt + 1) x 4.096 us x
/// 2^timeout` = 8 x 67 ms with our attributes); rxe on kernel 6.1 never completes WRs to
/// a destroyed QP, so without this watchdog the connection would only time out batch by
/// batch.
pub(crate) const STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a failing batch waits for its WRs to flush once the connection moved its QPs
/// to ERR, before its failure is reported anyway (its memory then stays pinned until they
/// have flushed). Flushing is local to the NIC (rxe: one pass of its completer), so this
/// is far more than it takes on real hardware; rxe under an emulated CPU on a loaded
/// host has taken a little longer.
pub(crate) const FLUSH_WAIT: Duration = Duration::from_millis(50);

/// How long after a break the health check waits for the WRs on the connection to flush
/// before it gives up on them (a QP that could not be moved to ERR, a provider that does
/// not flush): their batches' failures are reported then, and those batches keep their
/// pins until the QPs are destroyed with the connection. Well above [`FLUSH_WAIT`], so a
/// flush that comes after its failing batch stopped waiting still lets go of the memory.
pub(crate) const FLUSH_GIVE_UP: Duration = Duration::from_millis(500);

/// QP 0 of a connection idle this long gets a heartbeat (a zero-length WRITE): RC has no
/// keepalive, so without one a side that only receives never learns that its peer died.
pub(crate) const HEARTBEAT_IDLE: Duration = Duration::from_secs(2);

/// How often the completion thread (or, with manual progress, callers' rounds) check
/// connection health.
pub(crate) const HEALTH_EVERY: Duration = Duration::from_millis(50);

/// Manual progress: engine-wide caller rounds between two clock reads for the health
/// checks (a clock read is about as dear as the round itself under TCG).
pub(crate) const HEALTH_CLOCK_EVERY: u32 = 16;

/// What the health check of one QP decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to do.
    Healthy,
    /// WRs are outstanding and none completed for [`STALL_TIMEOUT`]: the peer is gone.
    Stalled,
    /// The heartbeat QP has been idle for [`HEARTBEAT_IDLE`]: send a heartbeat.
    Heartbeat,
}

/// The verdict for a QP with `outstanding` WRs that made no progress for `idle`;
/// `heartbeat_qp` for the QP that carries heartbeats (QP 0).
pub(crate) fn verdict(outstanding: u32, idle: Duration, heartbeat_qp: bool) -> Verdict {
    if outstanding > 0 && idle > STALL_TIMEOUT {
        Verdict::Stalled
    } else if heartbeat_qp && outstanding == 0 && idle >= HEARTBEAT_IDLE {
        Verdict::Heartbeat
    } else {
        Verdict::Healthy
    }
}

/// Whether a health check is due, `since` the last one.
pub(crate) fn due(since: Duration) -> bool {
    since >= HEALTH_EVERY
}

/// Why a connection broke, recorded once. Several threads can see a connection fail at
/// about the same time (the reaper of an error completion, the health check finding a QP in
/// ERR, a poster whose post failed); the first cause recorded stands, and everything that
/// reports the failure afterwards (failed batches, refused posts) carries that cause rather
/// than the one its own thread saw. Set means broken: there is no broken flag that could
/// be seen before its reason.
#[derive(Debug)]
pub(crate) struct FirstCause<E>(OnceLock<E>);

impl<E: Clone> FirstCause<E> {
    pub(crate) const fn new() -> Self {
        Self(OnceLock::new())
    }

    /// Records `cause` unless a cause is recorded already. Returns the cause that stands
    /// and whether it is `cause`.
    pub(crate) fn record(&self, cause: E) -> (E, bool) {
        let mut mine = false;
        let standing = self.0.get_or_init(|| {
            mine = true;
            cause
        });
        (standing.clone(), mine)
    }

    /// The cause, once one is recorded.
    pub(crate) fn get(&self) -> Option<&E> {
        self.0.get()
    }
}

/// A QP found in ERR: the state says that the QP failed, not why. The completion that says
/// why (a remote access error, say) was queued before the state changed (rxe completes the
/// failing WR, then moves the QP to ERR), so `drain` handles the queued completions first,
/// and may record that cause in `cause`. Returns the cause the state stands for, `symptom`,
/// only when nothing is recorded after the drain (a peer that vanished leaves no
/// completion); `None`: the connection broke already, for the recorded reason.
pub(crate) fn cause_of_error_state<E: Clone>(
    cause: &FirstCause<E>,
    drain: impl FnOnce(),
    symptom: impl FnOnce() -> E,
) -> Option<E> {
    drain();
    cause.get().is_none().then(symptom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let s = Duration::from_secs;
        assert_eq!(verdict(3, s(1), true), Verdict::Healthy);
        assert_eq!(verdict(3, s(6), false), Verdict::Stalled);
        assert_eq!(verdict(0, s(6), true), Verdict::Heartbeat);
        assert_eq!(verdict(0, s(6), false), Verdict::Healthy);
        assert_eq!(verdict(0, s(1), true), Verdict::Healthy);
        assert!(due(Duration::from_millis(50)) && !due(Duration::from_millis(49)));
    }

    #[test]
    fn the_first_cause_stands() {
        let c = FirstCause::new();
        assert_eq!(c.get(), None);
        assert_eq!(c.record("REM_ACCESS_ERR"), ("REM_ACCESS_ERR", true));
        // A later report (the health check finding the QP in ERR) gets the first cause
        // back, and changes nothing.
        assert_eq!(c.record("QP in ERR state"), ("REM_ACCESS_ERR", false));
        assert_eq!(c.get(), Some(&"REM_ACCESS_ERR"));
    }

    #[test]
    fn an_error_state_defers_to_the_completion_queued_before_it() {
        // The error completion was queued, not yet reaped: the drain records it, and the
        // state stands for nothing.
        let c = FirstCause::new();
        let got = cause_of_error_state(
            &c,
            || {
                c.record("REM_ACCESS_ERR");
            },
            || "QP in ERR state",
        );
        assert_eq!(got, None);
        assert_eq!(c.get(), Some(&"REM_ACCESS_ERR"));
        // No completion queued (the peer's QP vanished): the state is the cause.
        let c = FirstCause::<&str>::new();
        assert_eq!(
            cause_of_error_state(&c, || {}, || "QP in ERR state"),
            Some("QP in ERR state")
        );
        // Broken already, for another reason: nothing more to record.
        let c = FirstCause::new();
        c.record("closed");
        assert_eq!(cause_of_error_state(&c, || {}, || "QP in ERR state"), None);
    }
}
