//! A progress line on stderr, drawn only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Shows "[####......] 3/35 poll W=256: 120/500 grants" and redraws it in
/// place, at most ten times a second. Silent when stderr is not a terminal,
/// so logs and pipes stay clean.
pub struct Progress {
    enabled: bool,
    total: usize,
    done: usize,
    last: Option<Instant>,
    width: usize,
}

impl Progress {
    /// A bar over `total` steps, shown if stderr is a terminal.
    pub fn new(total: usize) -> Progress {
        Progress::with(total, std::io::stderr().is_terminal())
    }

    fn with(total: usize, enabled: bool) -> Progress {
        Progress {
            enabled,
            total: total.max(1),
            done: 0,
            last: None,
            width: 0,
        }
    }

    /// Redraws the line for the current step, with `what` it is doing.
    pub fn update(&mut self, what: &str) {
        if !self.enabled {
            return;
        }
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(Instant::now());
        let line = self.line(what);
        let pad = self.width.saturating_sub(line.chars().count());
        self.width = line.chars().count();
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{line}{}", " ".repeat(pad));
        let _ = err.flush();
    }

    fn line(&self, what: &str) -> String {
        const BAR: usize = 24;
        let filled = BAR * self.done / self.total;
        format!(
            "[{}{}] {}/{} {what}",
            "#".repeat(filled),
            ".".repeat(BAR - filled),
            self.done,
            self.total
        )
    }

    /// Counts one step as done.
    pub fn step(&mut self) {
        self.done = (self.done + 1).min(self.total);
        self.last = None;
    }

    /// Erases the line.
    pub fn finish(&mut self) {
        if self.enabled && self.width > 0 {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{}\r", " ".repeat(self.width));
            let _ = err.flush();
            self.width = 0;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fills() {
        let mut p = Progress::with(4, false);
        assert_eq!(p.line("x"), "[........................] 0/4 x");
        p.step();
        p.step();
        assert_eq!(p.line("y"), "[############............] 2/4 y");
        for _ in 0..9 {
            p.step();
        }
        assert!(p.line("").starts_with("[########################] 4/4"));
        // Disabled: nothing is written, nothing breaks.
        p.update("z");
        p.finish();
    }
}
