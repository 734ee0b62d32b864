//! What the process table says about other processes: parents and command
//! names, scheduler states and counts, read from outside without waking
//! the process.
//!
//! # Portability
//!
//! Linux reads `/proc`. Elsewhere a process's parent and name come from one
//! `ps -A -o pid= -o ppid= -o comm=` snapshot ([`ProcessTable`]); states
//! and scheduler counts of other processes are not readable without
//! privileges there, and those functions return `None`.

use std::io;

/// Parents and command names of the processes, as one consistent source.
///
/// Linux reads `/proc/PID/stat` at each lookup; other systems run `ps`
/// once, when the table is made.
#[derive(Debug)]
pub struct ProcessTable {
    /// `(pid, ppid, command name)` rows of a `ps` snapshot; `None` where
    /// `/proc` answers each lookup.
    snapshot: Option<Vec<(u32, u32, String)>>,
}

impl ProcessTable {
    /// Reads the table (a no-op where `/proc` is there).
    pub fn read() -> ProcessTable {
        if cfg!(target_os = "linux") && std::path::Path::new("/proc/self/stat").exists() {
            return ProcessTable { snapshot: None };
        }
        ProcessTable {
            snapshot: Some(ps_table()),
        }
    }

    /// Whether the table numbers processes as this process does: on
    /// Linux, a `/proc` mounted for another PID namespace (an `unshare
    /// --pid` without `--mount-proc`) names this process by another id,
    /// and the parent ids this process reads name other processes there.
    pub fn numbers_as_we_do(&self) -> bool {
        match &self.snapshot {
            None => std::fs::read_to_string("/proc/self/stat")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
                .is_some_and(|pid| pid == std::process::id()),
            Some(_) => true,
        }
    }

    /// Whether any process in the table but this one has a command name
    /// for which `wanted` holds.
    pub fn any_other_named(&self, wanted: impl Fn(&str) -> bool) -> bool {
        let me = std::process::id();
        match &self.snapshot {
            None => std::fs::read_dir("/proc").is_ok_and(|dir| {
                dir.flatten().any(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.parse::<u32>().ok())
                        .filter(|&pid| pid != me)
                        .and_then(|pid| self.parent_and_name(pid))
                        .is_some_and(|(_, name)| wanted(&name))
                })
            }),
            Some(rows) => rows.iter().any(|(pid, _, name)| *pid != me && wanted(name)),
        }
    }

    /// `(ppid, command name)` of `pid`, or `None` when it is not there (or
    /// not readable).
    pub fn parent_and_name(&self, pid: u32) -> Option<(u32, String)> {
        match &self.snapshot {
            None => {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let (ppid, name) = parse_stat(&stat)?;
                Some((ppid, untruncated(pid, name)))
            }
            Some(rows) => rows
                .iter()
                .find(|(p, _, _)| *p == pid)
                .map(|(_, ppid, name)| (*ppid, name.clone())),
        }
    }
}

/// The kernel keeps a command name of at most 15 bytes
/// (`TASK_COMM_LEN` − 1): `x86_64-linux-gnu-make` reads `x86_64-linux-gn`.
/// A name that long may have been cut; the file name of the first word of
/// `/proc/PID/cmdline` is the whole of it when it begins with the cut one.
fn untruncated(pid: u32, name: String) -> String {
    const CUT_AT: usize = 15;
    if name.len() != CUT_AT {
        return name;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return name;
    };
    let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    let base = argv0.rsplit(|&b| b == b'/').next().unwrap_or_default();
    match std::str::from_utf8(base) {
        Ok(whole) if whole.len() > CUT_AT && whole.starts_with(&name) => whole.to_owned(),
        _ => name,
    }
}

/// `(ppid, comm)` from the text of a `/proc/PID/stat`. The name is in
/// parentheses and may itself hold spaces and parentheses, so the fields
/// after it are found from the last `)`.
pub fn parse_stat(stat: &str) -> Option<(u32, String)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_owned();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let _state = rest.next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some((ppid, name))
}

fn ps_table() -> Vec<(u32, u32, String)> {
    let Ok(out) = std::process::Command::new("ps")
        .args(["-A", "-o", "pid=", "-o", "ppid=", "-o", "comm="])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let pid = f.next()?.parse().ok()?;
            let ppid = f.next()?.parse().ok()?;
            let name = f.collect::<Vec<_>>().join(" ");
            Some((pid, ppid, name))
        })
        .collect()
}

/// The scheduler's state letter of process `pid` (`S` asleep, `R`
/// running, …): Linux's `/proc/PID/stat`; `None` elsewhere or when the
/// process is gone.
pub fn process_state(pid: u32) -> Option<char> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.trim_start().chars().next()
}

/// What the scheduler has counted for one process, all threads together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedCount {
    /// User + system time, in ns.
    pub cpu_ns: u64,
    /// Time spent ready to run but waiting for a CPU, in ns.
    pub runqueue_ns: u64,
    /// Voluntary context switches: sleeps.
    pub sleeps: u64,
}

/// Process `pid`'s [`SchedCount`], read without waking it.
///
/// Linux: the first two fields of `/proc/PID/task/TID/schedstat` (the run
/// time the scheduler keeps, exact to the nanosecond, and the time spent on
/// a run queue) and
/// `voluntary_ctxt_switches` of `/proc/PID/task/TID/status`, summed over
/// the threads. `None` where they are not readable (other systems; kernels
/// without `CONFIG_SCHED_INFO`).
pub fn sched_count(pid: u32) -> Option<SchedCount> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let mut total = SchedCount::default();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = task.ok()?.path();
        let sched = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        let mut fields = sched.split_whitespace();
        total.cpu_ns += fields.next()?.parse::<u64>().ok()?;
        total.runqueue_ns += fields.next()?.parse::<u64>().ok()?;
        let status = std::fs::read_to_string(dir.join("status")).ok()?;
        total.sleeps += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
            .trim()
            .parse::<u64>()
            .ok()?;
    }
    Some(total)
}

/// The id of the calling thread (Linux's `gettid`); `None` elsewhere.
pub fn current_tid() -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        Some(nix::unistd::gettid().as_raw())
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Resident memory of process `pid`, in KiB: `(peak, now)`, from Linux's
/// `/proc/PID/status` (`VmHWM`, `VmRSS`); `None` elsewhere or when the
/// process is gone.
pub fn resident_kib(pid: u32) -> Option<(u64, u64)> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// Makes this process die (SIGKILL) when its parent does. Linux only
/// (`PR_SET_PDEATHSIG`); elsewhere `Unsupported`.
pub fn die_with_parent() -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// A descriptor that turns readable once process `pid` has exited, for an
/// event loop to watch: a pidfd on Linux (5.3 and later). Elsewhere an
/// `Unsupported` error: see the BSD backend.
pub fn process_exit_fd(pid: u32) -> io::Result<std::os::fd::OwnedFd> {
    crate::sys::process_exit_fd(pid)
}

/// Whether this process runs in a PID namespace below the initial one
/// (a container's, an `unshare --pid`'s): Linux numbers the initial one
/// with a fixed inode (`PROC_PID_INIT_INO`). `false` where there are none.
pub fn in_child_pid_namespace() -> bool {
    const PROC_PID_INIT_INO: u32 = 0xEFFF_FFFC;
    pid_namespace().is_some_and(|ns| ns != PROC_PID_INIT_INO)
}

/// The identity of this process's PID namespace (the inode of
/// `/proc/self/ns/pid`, low 32 bits) on Linux: two processes whose values
/// differ number processes differently, so a process id one of them
/// names means nothing to the other. `None` where there is no such file.
pub fn pid_namespace() -> Option<u32> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self/ns/pid")
            .ok()
            .map(|m| m.ino() as u32)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines() {
        assert_eq!(
            parse_stat("42 (make) S 7 42 42 0 -1"),
            Some((7, "make".to_owned()))
        );
        assert_eq!(
            parse_stat("43 (a (b) c) R 42 1"),
            Some((42, "a (b) c".to_owned()))
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_in_the_table() {
        let table = ProcessTable::read();
        let (ppid, _) = table
            .parent_and_name(std::process::id())
            .expect("this process");
        assert_eq!(ppid, std::os::unix::process::parent_id());
    }

    /// A name over 15 bytes, which the kernel's command name cuts, reads
    /// whole.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_long_command_name_reads_whole() {
        let dir = std::env::temp_dir().join(format!("herdless-long-name-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let program = dir.join("x86_64-linux-gnu-bmake");
        std::fs::copy("/bin/sleep", &program).unwrap();
        let mut child = std::process::Command::new(&program)
            .arg("30")
            .spawn()
            .unwrap();
        // Read once it sleeps, its exec done: in the middle of one the new
        // name is set before the new arguments are, and a process whose
        // name reads cut has no whole one to read yet. (Every process the
        // recipe walk reads is an ancestor of a running client.)
        let start = std::time::Instant::now();
        let pid = child.id();
        let args_set =
            || std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty());
        while (process_state(pid) != Some('S') || !args_set())
            && start.elapsed() < std::time::Duration::from_secs(10)
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let row = ProcessTable::read().parent_and_name(child.id());
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            row,
            Some((std::process::id(), "x86_64-linux-gnu-bmake".to_owned()))
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_states_and_counts() {
        let me = std::process::id();
        // The main thread (the test harness's, waiting or running).
        assert!(matches!(process_state(me), Some('S' | 'R')));
        assert_eq!(process_state(u32::MAX), None);
        let c = sched_count(me).expect("schedstat");
        assert!(c.cpu_ns > 0);
        let (peak, now) = resident_kib(me).expect("VmHWM and VmRSS");
        assert!(peak >= now && now > 0);
    }
}
