//! A progress bar on stderr for runs longer than two seconds: drawn only on a terminal
//! and never with `--json`, so scripts and pipes see nothing of it.
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long a run goes before its bar appears.
const SHOW_AFTER: Duration = Duration::from_secs(2);

/// What the bar counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Operations, batches or pings: a known total.
    Count(&'static str),
    /// Milliseconds of a timed (`-D`) run.
    Millis,
}

/// A bar that stays hidden until the run has lasted [`SHOW_AFTER`]. Updating it is a
/// counter increment; the clock is read only every `stride` updates, so a latency loop
/// that ticks every ping is not slowed down by it.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    unit: Unit,
    enabled: bool,
    shown: bool,
    start: Instant,
    count: u64,
    calls: u64,
    stride: u64,
}

/// Whether a bar may be drawn at all: text output (not `--json`) on a terminal, by the
/// end that prints the report.
pub fn wanted(json: bool, print: bool) -> bool {
    print && !json && std::io::stderr().is_terminal()
}

impl Progress {
    /// A bar of `total` in `unit`, checked every `stride` updates.
    pub fn new(total: u64, unit: Unit, enabled: bool, stride: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
        let template = match unit {
            Unit::Count(what) => {
                format!(" {{bar:40}} {{pos}}/{{len}} {what}  {{elapsed_precise}} eta {{eta}}")
            }
            Unit::Millis => " {bar:40} {elapsed_precise} of a timed run, eta {eta}".to_string(),
        };
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar.set_style(style);
        }
        Progress {
            bar,
            unit,
            enabled,
            shown: false,
            start: Instant::now(),
            count: 0,
            calls: 0,
            stride: stride.max(1),
        }
    }

    /// A bar that never shows.
    pub fn hidden() -> Progress {
        Progress::new(0, Unit::Millis, false, 1)
    }

    /// Counts `n` more units done (ignored for timed runs, whose position is the clock).
    pub fn add(&mut self, n: u64) {
        self.count += n;
        self.calls += 1;
        if !self.enabled || !self.calls.is_multiple_of(self.stride) {
            return;
        }
        let elapsed = self.start.elapsed();
        if !self.shown {
            if elapsed < SHOW_AFTER {
                return;
            }
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        match self.unit {
            Unit::Count(_) => self.bar.set_position(self.count),
            Unit::Millis => self.bar.set_position(elapsed.as_millis() as u64),
        }
    }

    /// Runs `f` (which prints a report line) with the bar out of the way.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// Removes the bar (the report follows on stdout).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_without_drawing_when_disabled() {
        let mut p = Progress::new(10, Unit::Count("ops"), false, 1);
        for _ in 0..10 {
            p.add(1);
        }
        assert_eq!(p.count, 10);
        assert!(!p.shown);
        let mut h = Progress::hidden();
        h.add(5);
        assert!(!h.shown);
    }
}
