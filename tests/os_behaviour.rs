//! What each kernel does when many processes wait on one pipe (ARCHITECTURE §2),
//! and herdless's single wake-up beside it, with real waiter processes.
//!
//! Only counts the kernel guarantees are asserted: how many processes one
//! token wakes when every waiter sleeps, never a timing. Each test spawns
//! the `herdless` binary as its waiters (`herdless bench worker waiter`).

use herdless_bench::{run_cell, BenchMode, CellConfig, CellResult};
use herdless_platform::wait::Mode;

fn run(mode: BenchMode, waiters: u32, grants: u64) -> CellResult {
    let cfg = CellConfig {
        exe: env!("CARGO_BIN_EXE_herdless").into(),
        mode,
        waiters,
        grants,
        tokens: 1,
        settle: false,
    };
    run_cell(&cfg, &mut |_| {}).unwrap_or_else(|e| panic!("{mode} with {waiters} waiters: {e}"))
}

/// One token, every waiter asleep: checks that `want` of them woke.
fn assert_woken_by_one_token(mode: BenchMode, waiters: u32, want: usize) {
    let r = run(mode, waiters, 1);
    assert_eq!(r.grants, 1, "{mode}: one token, one claim");
    assert_eq!(
        r.processes_woken(),
        want,
        "{mode}: wake-ups of each of {waiters} waiters {:?}, token to {:?}",
        r.wakeups_by_waiter,
        r.winners
    );
}

/// Herdless: each waiter woke exactly as often as it was handed a token,
/// so every grant woke one process and no other. With one token among 32
/// or more waiters, the waiter a grant goes to has been queued behind all
/// the others, long enough to be asleep.
fn assert_one_wakeup_per_grant(waiters: u32, grants: u64) {
    let r = run(BenchMode::Herdless, waiters, grants);
    assert!(r.grants >= grants);
    // Every grant's release was reported, the waiters' own give-backs a
    // grant late or in their final records.
    assert_eq!(r.handoffs_ns.len() as u64, r.grants, "{r:#?}");
    if cfg!(target_vendor = "apple") {
        // macOS counts every switch, preemptions of a running waiter too:
        // a waiter that got no token must not have run at all.
        for (w, g) in r.wakeups_by_waiter.iter().zip(&r.grants_by_waiter) {
            assert!(*g > 0 || *w == 0, "{r:#?}");
        }
    } else {
        // Each waiter wakes once per token it is handed. A herd would show
        // every waiter waking at nearly every grant; a loaded machine can
        // add the odd sleep of a waiter's own (a page fault, a record write
        // that blocks), hence a margin of two per waiter, which no herd
        // fits in.
        for (i, (w, g)) in r
            .wakeups_by_waiter
            .iter()
            .zip(&r.grants_by_waiter)
            .enumerate()
        {
            assert!(
                *w <= *g + 2,
                "waiter {i} of {waiters} woke {w} times for {g} grants: {r:#?}"
            );
        }
        assert!(
            r.wakeups <= r.grants + u64::from(waiters) / 8 + 2,
            "{} wake-ups for {} grants among {waiters} waiters",
            r.wakeups,
            r.grants
        );
        assert!(
            r.wakeups >= r.grants / 2,
            "wake-ups were not counted: {r:#?}"
        );
    }
}

#[test]
fn herdless_wakes_exactly_one_of_32() {
    assert_woken_by_one_token(BenchMode::Herdless, 32, 1);
    assert_one_wakeup_per_grant(32, 64);
}

#[test]
fn herdless_wakes_exactly_one_of_256() {
    assert_one_wakeup_per_grant(256, 256);
}

/// More waiters than a table of 1024 slots held (with the releaser, 1025
/// clients): every one of them still waits in the table, so no wait at
/// the broker closes it and moves the others (a second wake-up each).
#[test]
fn herdless_wakes_exactly_one_of_1100() {
    assert_one_wakeup_per_grant(1100, 300);
}

#[cfg(target_os = "linux")]
mod linux {
    use super::*;

    #[test]
    fn poll_wakes_every_waiter() {
        assert_woken_by_one_token(BenchMode::Kernel(Mode::Poll), 32, 32);
    }

    /// Linux 5.6 made a blocking pipe read an exclusive wait (commit
    /// 0ddad21d3e99).
    #[test]
    fn blocking_read_wakes_one() {
        let caps = herdless_platform::capabilities();
        if !caps.exclusive_pipe_read {
            eprintln!(
                "skipped: Linux {} predates exclusive pipe reads (5.6); every reader wakes",
                caps.kernel.release
            );
            return;
        }
        assert_woken_by_one_token(BenchMode::Kernel(Mode::BlockingRead), 32, 1);
    }

    /// EPOLLEXCLUSIVE promises "one or more" wake-ups (epoll_ctl(2)); what
    /// holds is that one waiter claims the token and the others go on
    /// waiting.
    #[test]
    fn epoll_exclusive_lets_exactly_one_waiter_claim() {
        let r = run(BenchMode::Kernel(Mode::EpollExclusive), 32, 1);
        assert_eq!(r.grants_by_waiter.iter().sum::<u64>(), 1);
        assert_eq!(r.grants_by_waiter.iter().filter(|&&g| g == 1).count(), 1);
        let woken = r.processes_woken();
        assert!((1..=32).contains(&woken), "woken: {woken}");
        eprintln!("epoll-exclusive: one token woke {woken} of 32 waiters");
    }

    #[test]
    fn futex_wakes_one() {
        assert_woken_by_one_token(BenchMode::Kernel(Mode::Futex), 32, 1);
    }
}

#[cfg(any(target_os = "freebsd", target_os = "netbsd", target_vendor = "apple"))]
mod bsd {
    use super::*;

    /// A pipe write activates every process's knote: kqueue has no
    /// exclusive mode, with `EV_CLEAR` or `EV_DISPATCH` alike.
    #[test]
    fn kqueue_wakes_every_waiter() {
        for mode in [Mode::KqueueClear, Mode::KqueueDispatch] {
            assert_woken_by_one_token(BenchMode::Kernel(mode), 32, 32);
        }
    }
}
