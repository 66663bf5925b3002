//! Connection health as verdicts: given what a connection's QP has outstanding and how
//! long it made no progress, whether it is stalled (a dead peer), needs a heartbeat, or is
//! fine. Pure functions of (state, elapsed time); the caller reads the clock and acts.

use std::time::Duration;

/// A QP with WRs outstanding and no progress for this long counts as a dead peer.
/// Hardware reports a dead peer itself (RETRY_EXC_ERR after `(retry_cnt + 1) x 4.096 us x
/// 2^timeout` = 8 x 67 ms with our attributes); rxe on kernel 6.1 never completes WRs to
/// a destroyed QP, so without this watchdog the connection would only time out batch by
/// batch.
pub(crate) const STALL_TIMEOUT: Duration = Duration::from_secs(5);

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
}
