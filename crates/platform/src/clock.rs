//! One clock for every process on the machine.

use std::time::Duration;

use nix::time::{clock_gettime, ClockId};

/// `clock_gettime(CLOCK_MONOTONIC)` — time since an unspecified start,
/// never going back, and the same clock in every process of the machine.
///
/// A [`std::time::Instant`] cannot leave the process that took it; this
/// value can be passed to another process (through a pipe, a file) and
/// compared with one taken there, e.g. to time a hand-off from the process
/// that releases a token to the one that gets it.
///
/// # Panics
///
/// Never in practice: `clock_gettime()` fails only for an unknown clock,
/// and every supported system has `CLOCK_MONOTONIC` (macOS since 10.12).
///
/// # Portability
///
/// Linux, the BSDs and macOS. The clock stops while the machine is
/// suspended on Linux and macOS, and keeps counting on FreeBSD; either way
/// two readings on one machine compare.
pub fn monotonic() -> Duration {
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always readable");
    let secs = u64::try_from(ts.tv_sec()).unwrap_or(0);
    let nanos = u32::try_from(ts.tv_nsec()).unwrap_or(0);
    Duration::new(secs, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_back_and_follows_instant() {
        let a = monotonic();
        let start = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        let elapsed = start.elapsed();
        let b = monotonic();
        // The span read with `monotonic` encloses the one `Instant` read
        // inside it, however long the thread was preempted in between.
        assert!(b - a >= elapsed, "{a:?} {b:?} {elapsed:?}");
    }
}
