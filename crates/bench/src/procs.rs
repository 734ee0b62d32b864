//! Worker processes: starting them, checking they live, knowing when all of
//! them sleep, and never leaving one behind.

use std::io;
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use herdless_platform::{sched_count, SchedCount};
use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// The worker processes of one run. Dropping it kills and reaps those still
/// running.
pub(crate) struct Workers {
    children: Vec<Child>,
    what: &'static str,
}

impl Workers {
    /// `what` names the workers in errors ("waiter", "make").
    pub(crate) fn new(what: &'static str) -> Workers {
        Workers {
            children: Vec::new(),
            what,
        }
    }

    pub(crate) fn spawn(&mut self, mut cmd: Command) -> io::Result<()> {
        let child = cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot start {} process {}: {e}",
                    self.what,
                    self.children.len()
                ),
            )
        })?;
        self.children.push(child);
        Ok(())
    }

    /// The workers' process ids, in the order they were started.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// An error naming the first worker that has exited, if one has.
    pub(crate) fn check_alive(&mut self) -> io::Result<()> {
        for (i, child) in self.children.iter_mut().enumerate() {
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "{} {i} (pid {}) exited early: {status}",
                    self.what,
                    child.id()
                )));
            }
        }
        Ok(())
    }

    /// Waits for every worker to exit, killing those still running after
    /// `limit`. An error names a worker that failed.
    pub(crate) fn reap(&mut self, limit: Duration) -> io::Result<()> {
        let deadline = Instant::now() + limit;
        let mut failed = None;
        for (i, child) in self.children.iter_mut().enumerate() {
            let status = loop {
                if let Some(s) = child.try_wait()? {
                    break s;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break child.wait()?;
                }
                thread::sleep(Duration::from_millis(2));
            };
            if !status.success() && failed.is_none() {
                failed = Some(format!("{} {i} ended with {status}", self.what));
            }
        }
        self.children.clear();
        match failed {
            Some(msg) => Err(io::Error::other(msg)),
            None => Ok(()),
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
        }
        for child in &mut self.children {
            let _ = child.wait();
        }
    }
}

/// Waits until every process in `pids` is asleep, so that the next
/// wake-up of each is one the caller caused.
///
/// # Portability
///
/// Linux reads each process's state from `/proc/PID/stat` and returns once
/// two scans 2 ms apart find all of them sleeping (`S`). Elsewhere no
/// other process's state is readable without privileges, and this sleeps
/// 50 ms plus 0.2 ms per process, which is ample for a process that has
/// reported ready to reach its wait call.
pub(crate) fn wait_all_asleep(pids: &[u32], limit: Duration) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let start = Instant::now();
        let mut calm_scans = 0;
        while calm_scans < 2 {
            let awake = pids
                .iter()
                .find(|&&pid| !matches!(herdless_platform::process_state(pid), Some('S')));
            match awake {
                None => calm_scans += 1,
                Some(&pid) => {
                    calm_scans = 0;
                    if start.elapsed() > limit {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "process {pid} is still not asleep after {} s (state {:?})",
                                limit.as_secs(),
                                herdless_platform::process_state(pid)
                            ),
                        ));
                    }
                }
            }
            thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = limit;
        let per = Duration::from_micros(200) * u32::try_from(pids.len()).unwrap_or(u32::MAX);
        thread::sleep(Duration::from_millis(50) + per);
        Ok(())
    }
}

/// Each process's scheduler counts ([`SchedCount`]), read from outside
/// without waking it; `None` where the platform cannot read them (callers
/// then use the processes' own `getrusage()`).
pub(crate) fn counted(pids: &[u32]) -> Option<Vec<SchedCount>> {
    pids.iter().map(|&pid| sched_count(pid)).collect()
}

/// Makes this worker die with its coordinator, so that no waiter sleeps on
/// forever when the benchmark is killed (a futex waiter has nothing else to
/// wake it). Linux only; elsewhere the FIFO or socket a worker waits on
/// closes with its coordinator, except for the futex mode.
pub(crate) fn die_with_parent() {
    let _ = herdless_platform::die_with_parent();
}

/// Checks (and where it can, raises) the limits `processes` more worker
/// processes and `fds` more descriptors in this process need.
///
/// # Errors
///
/// A message naming the limit and how to raise it.
pub(crate) fn ensure_limits(processes: u64, fds: u64) -> io::Result<()> {
    use nix::sys::resource::RLIM_INFINITY;
    // rlim_t is unsigned on Linux and macOS, signed on the BSDs.
    let lim = |n: u64| libc::rlim_t::try_from(n).unwrap_or(RLIM_INFINITY);
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let want = lim(fds + 64);
    if soft != RLIM_INFINITY && soft < want {
        if hard == RLIM_INFINITY || hard >= want {
            setrlimit(Resource::RLIMIT_NOFILE, want, hard)?;
        } else {
            return Err(io::Error::other(format!(
                "this run needs about {want} open files in one process, but the limit is \
                 {soft} (hard limit {hard}); raise it with `ulimit -n {want}` or use fewer waiters"
            )));
        }
    }
    // nix has no RLIMIT_NPROC for Apple systems; there fork() reports the
    // limit when it is reached.
    #[cfg(not(target_vendor = "apple"))]
    {
        let (nproc, _) = getrlimit(Resource::RLIMIT_NPROC)?;
        let want = lim(processes + 32);
        if nproc != RLIM_INFINITY && nproc < want {
            return Err(io::Error::other(format!(
                "this run starts {processes} processes, but this user may have at most {nproc} \
                 (`ulimit -u`); raise it or use fewer waiters"
            )));
        }
    }
    #[cfg(target_vendor = "apple")]
    let _ = processes;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_process_states() {
        // The main thread of the test binary: running or waiting.
        assert!(herdless_platform::process_state(std::process::id()).is_some());
        let mut sleeper = Command::new("sleep").arg("5").spawn().unwrap();
        wait_all_asleep(&[sleeper.id()], Duration::from_secs(5)).unwrap();
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        assert_eq!(herdless_platform::process_state(u32::MAX), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_cpu_time_from_outside() {
        let me = std::process::id();
        let a = counted(&[me]).unwrap()[0];
        crate::make::spin(5_000_000);
        std::thread::sleep(Duration::from_millis(2));
        let b = counted(&[me]).unwrap()[0];
        assert!(b.cpu_ns > a.cpu_ns, "{a:?} {b:?}");
        assert!(b.sleeps > a.sleeps, "{a:?} {b:?}");
        assert_eq!(counted(&[u32::MAX]), None);
    }

    #[test]
    fn small_needs_fit() {
        ensure_limits(1, 8).unwrap();
    }

    #[test]
    fn dropping_workers_kills_them() {
        let mut w = Workers::new("sleeper");
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        w.spawn(cmd).unwrap();
        w.check_alive().unwrap();
        let pid = w.children[0].id();
        drop(w);
        // Reaped: the pid no longer names our child.
        assert!(nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(pid as i32),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG)
        )
        .is_err());
    }
}
