//! The outcome cell of a prepared batch's runs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::core::registry::Pins;
use crate::error::{Error, Result};

/// A run is in flight.
const RUNNING: u8 = 0;
/// The last run completed (or none was started).
const DONE: u8 = 1;
/// The last run failed; the error is in `RunCell::error`.
const FAILED: u8 = 2;

/// The outcome of a prepared batch's current run, and the pins of its local regions. A
/// backend's in-flight work holds it (through its batch control), so the regions stay
/// registered until the last WR of a run has completed or been flushed, even when the
/// [`PreparedBatch`] is dropped first.
#[derive(Debug)]
pub(crate) struct RunCell {
    state: AtomicU8,
    error: Mutex<Option<Error>>,
    _pins: Pins,
}

impl RunCell {
    pub(crate) fn new(pins: Pins) -> Self {
        RunCell {
            state: AtomicU8::new(DONE),
            error: Mutex::new(None),
            _pins: pins,
        }
    }

    /// The run completed successfully (ignored unless one is in flight).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only lanes report runs
    pub(crate) fn succeed(&self) {
        let _ = self
            .state
            .compare_exchange(RUNNING, DONE, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The run failed with `err` (the first outcome wins).
    pub(crate) fn fail(&self, err: Error) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(Ordering::Acquire) == RUNNING {
            *e = Some(err);
            self.state.store(FAILED, Ordering::Release);
        }
    }

    /// A new run. The previous run's error needs no clearing: it is read only in the
    /// FAILED state, which only a new `fail` (overwriting it) can enter.
    pub(crate) fn begin(&self) {
        self.state.store(RUNNING, Ordering::Release);
    }

    /// `None` while running.
    pub(crate) fn outcome(&self) -> Option<Result<()>> {
        match self.state.load(Ordering::Acquire) {
            RUNNING => None,
            DONE => Some(Ok(())),
            _ => Some(Err(self.error())),
        }
    }

    /// The error of a FAILED run (`Cancelled` if none was recorded).
    #[cold]
    fn error(&self) -> Error {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or(Error::Cancelled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_cell_first_outcome_wins_and_begin_resets() {
        let c = RunCell::new(Pins::new());
        assert!(matches!(c.outcome(), Some(Ok(()))), "idle reads as done");
        c.begin();
        assert!(c.outcome().is_none());
        c.fail(Error::Cancelled);
        c.succeed();
        assert!(matches!(c.outcome(), Some(Err(Error::Cancelled))));
        c.begin();
        c.succeed();
        c.fail(Error::Shutdown);
        assert!(matches!(c.outcome(), Some(Ok(()))));
        // An outcome with no run in flight is ignored.
        c.fail(Error::Shutdown);
        assert!(matches!(c.outcome(), Some(Ok(()))));
    }
}
