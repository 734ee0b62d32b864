//! CPU time and context switches: how wake-ups are counted.

use std::io;
use std::time::Duration;

use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::time::TimeVal;

use crate::sys;

/// Context switches of one task, from `/proc/PID/status`.
///
/// A voluntary switch is a sleep: each wake-up of a blocked waiter adds one.
/// An involuntary switch is a preemption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CtxSwitches {
    /// `voluntary_ctxt_switches`.
    pub voluntary: u64,
    /// `nonvoluntary_ctxt_switches`.
    pub involuntary: u64,
}

impl CtxSwitches {
    /// `self - earlier`, per field, saturating at zero.
    pub fn since(self, earlier: CtxSwitches) -> CtxSwitches {
        CtxSwitches {
            voluntary: self.voluntary.saturating_sub(earlier.voluntary),
            involuntary: self.involuntary.saturating_sub(earlier.involuntary),
        }
    }
}

/// Reads the context-switch counters of process `pid` from
/// `/proc/PID/status`.
///
/// The counters are those of the task whose id is `pid`: for a process,
/// its main thread only. Use [`self_rusage`] for the sum over all threads
/// of this process.
///
/// # Errors
///
/// `NotFound` when there is no such process (or `/proc` is not mounted),
/// `InvalidData` when the file lacks the two counters, `Unsupported` on
/// systems without them.
///
/// # Portability
///
/// Linux only (`/proc/PID/status` has had the counters since 2.6.23).
/// Elsewhere it returns an `Unsupported` error; the BSDs have no per-process
/// counters readable by another unprivileged process without `kvm(3)`.
pub fn process_ctx_switches(pid: i32) -> io::Result<CtxSwitches> {
    sys::process_ctx_switches(pid)
}

/// The context switches of every thread of process `pid`, summed: whether
/// any thread of it ran, where [`process_ctx_switches`] counts the thread
/// whose id is `pid` only.
///
/// # Errors
///
/// As [`process_ctx_switches`]; a thread that exits while being read is
/// skipped.
///
/// # Portability
///
/// Linux only (`/proc/PID/task`); elsewhere `Unsupported`.
pub fn process_ctx_switches_all_threads(pid: i32) -> io::Result<CtxSwitches> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        // Gives the precise error: no such process, or no counters here.
        return process_ctx_switches(pid);
    };
    let mut total = CtxSwitches::default();
    for task in tasks {
        let tid = task?.file_name().to_string_lossy().parse::<i32>();
        let Ok(tid) = tid else { continue };
        match process_ctx_switches(tid) {
            Ok(c) => {
                total.voluntary += c.voluntary;
                total.involuntary += c.involuntary;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// Parses the `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches`
/// lines of a Linux `/proc/PID/status` file.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) fn parse_proc_status(status: &str) -> io::Result<CtxSwitches> {
    let mut voluntary = None;
    let mut involuntary = None;
    for line in status.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let slot = match key {
            "voluntary_ctxt_switches" => &mut voluntary,
            "nonvoluntary_ctxt_switches" => &mut involuntary,
            _ => continue,
        };
        *slot = value.trim().parse::<u64>().ok();
    }
    match (voluntary, involuntary) {
        (Some(voluntary), Some(involuntary)) => Ok(CtxSwitches {
            voluntary,
            involuntary,
        }),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "status file has no readable voluntary_ctxt_switches and nonvoluntary_ctxt_switches",
        )),
    }
}

/// CPU time and context switches, from `getrusage()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Usage {
    /// `ru_utime`: time spent in user mode.
    pub user: Duration,
    /// `ru_stime`: time spent in the kernel.
    pub system: Duration,
    /// `ru_nvcsw`: voluntary context switches (sleeps, hence wake-ups).
    pub voluntary_ctx: u64,
    /// `ru_nivcsw`: involuntary context switches (preemptions).
    pub involuntary_ctx: u64,
}

impl Usage {
    /// `user + system`.
    pub fn cpu(&self) -> Duration {
        self.user + self.system
    }

    /// `self - earlier`, per field, saturating at zero.
    pub fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
            voluntary_ctx: self.voluntary_ctx.saturating_sub(earlier.voluntary_ctx),
            involuntary_ctx: self.involuntary_ctx.saturating_sub(earlier.involuntary_ctx),
        }
    }
}

fn rusage(who: UsageWho) -> io::Result<Usage> {
    let u = getrusage(who)?;
    Ok(Usage {
        user: duration(u.user_time()),
        system: duration(u.system_time()),
        voluntary_ctx: u64::try_from(u.voluntary_context_switches()).unwrap_or(0),
        involuntary_ctx: u64::try_from(u.involuntary_context_switches()).unwrap_or(0),
    })
}

fn duration(tv: TimeVal) -> Duration {
    let secs = u64::try_from(tv.tv_sec()).unwrap_or(0);
    let micros = u32::try_from(tv.tv_usec()).unwrap_or(0);
    Duration::from_secs(secs) + Duration::from_micros(micros.into())
}

/// `getrusage(RUSAGE_SELF)` — CPU time and context switches of this
/// process, summed over all its threads, live and exited.
///
/// # Errors
///
/// The OS error of `getrusage()`; in practice it does not fail.
///
/// # Portability
///
/// All Unix systems. Linux, FreeBSD, NetBSD and macOS fill in the context
/// switch counters.
pub fn self_rusage() -> io::Result<Usage> {
    rusage(UsageWho::RUSAGE_SELF)
}

/// `getrusage(RUSAGE_THREAD)` — the same for the calling thread alone:
/// what a service thread (the broker's, inside a host program) costs,
/// apart from the threads around it.
///
/// # Errors
///
/// `ErrorKind::Unsupported` where the OS has no per-thread usage;
/// otherwise the OS error of `getrusage()`.
///
/// # Portability
///
/// Linux, FreeBSD and OpenBSD; not NetBSD or macOS.
pub fn thread_rusage() -> io::Result<Usage> {
    #[cfg(any(target_os = "linux", target_os = "freebsd", target_os = "openbsd"))]
    return rusage(UsageWho::RUSAGE_THREAD);
    #[cfg(not(any(target_os = "linux", target_os = "freebsd", target_os = "openbsd")))]
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no per-thread resource usage on this OS",
    ))
}

/// `getrusage(RUSAGE_CHILDREN)` — the same for all children of this process
/// that have terminated and been waited for, and their waited-for
/// descendants. A child counts only after `wait()` has reaped it.
///
/// # Errors
///
/// The OS error of `getrusage()`; in practice it does not fail.
///
/// # Portability
///
/// As [`self_rusage`].
pub fn children_rusage() -> io::Result<Usage> {
    rusage(UsageWho::RUSAGE_CHILDREN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status() {
        let text = "Name:\tcat\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(
            parse_proc_status(text).unwrap(),
            CtxSwitches {
                voluntary: 12,
                involuntary: 3
            }
        );
        assert_eq!(
            parse_proc_status("Name:\tcat\n").unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[cfg(any(target_os = "linux", target_os = "freebsd", target_os = "openbsd"))]
    #[test]
    fn a_threads_usage_is_its_own() {
        // Sleeps on this thread raise its count; a second thread's sleeps
        // do not.
        let before = thread_rusage().unwrap().voluntary_ctx;
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let slept = thread_rusage().unwrap().voluntary_ctx;
        assert!(slept >= before + 3, "{before} then {slept}");
        std::thread::spawn(|| {
            for _ in 0..20 {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .join()
        .unwrap();
        let after = thread_rusage().unwrap().voluntary_ctx;
        // The join itself may sleep once.
        assert!(after <= slept + 2, "{slept} then {after}");
        assert!(self_rusage().unwrap().voluntary_ctx >= after + 20);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn own_ctx_switches_are_readable_and_grow_with_sleeps() {
        let pid = std::process::id() as i32;
        // Count on a thread of our own whose id we know: /proc/PID/status
        // reports one task, and the test harness runs us off the main thread.
        let tid = nix::unistd::gettid().as_raw();
        let before = process_ctx_switches(tid).unwrap();
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let after = process_ctx_switches(tid).unwrap();
        assert!(after.since(before).voluntary >= 3, "{before:?} {after:?}");
        process_ctx_switches(pid).unwrap();
    }

    #[cfg(not(target_os = "linux"))]
    #[test]
    fn ctx_switches_are_unsupported() {
        let err = process_ctx_switches(std::process::id() as i32).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
    }

    #[test]
    fn no_such_process() {
        // Above the default pid_max of every supported system.
        #[cfg(target_os = "linux")]
        assert_eq!(
            process_ctx_switches(i32::MAX).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn rusage_counts_our_sleeps() {
        let before = self_rusage().unwrap();
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let after = self_rusage().unwrap();
        assert!(after.since(&before).voluntary_ctx >= 3);
        assert!(after.cpu() >= before.cpu());
        children_rusage().unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn all_threads_include_a_sleeping_thread() {
        let pid = std::process::id() as i32;
        let (slept_tx, slept_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        // Another thread sleeps five times, then stays alive until read.
        let t = std::thread::spawn(move || {
            for _ in 0..5 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            slept_tx.send(()).unwrap();
            let _ = done_rx.recv();
        });
        slept_rx.recv().unwrap();
        let main_only = process_ctx_switches(pid).unwrap();
        let all = process_ctx_switches_all_threads(pid).unwrap();
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(
            all.voluntary >= main_only.voluntary + 5,
            "{main_only:?} {all:?}"
        );
        assert!(process_ctx_switches_all_threads(i32::MAX).is_err());
    }
}
