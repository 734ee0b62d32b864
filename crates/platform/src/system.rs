//! What the whole machine is doing, for admission limits and caps: the
//! load average, the memory available, a process's parent; and the
//! listening sockets a service manager passes (socket activation).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// The 1-minute load average: `getloadavg(3)`. `None` when the system does
/// not report it.
///
/// # References
/// - Linux, FreeBSD, NetBSD, macOS: `getloadavg(3)`
pub fn load_average() -> Option<f64> {
    let mut loads = [0f64; 1];
    // SAFETY: `loads` is a valid, writable array of one f64, and we ask for
    // at most one sample.
    let n = unsafe { libc::getloadavg(loads.as_mut_ptr(), 1) };
    (n == 1).then_some(loads[0])
}

/// Memory available to new work without swapping, in bytes: Linux's
/// `MemAvailable` from `/proc/meminfo`. `None` where the kernel does not
/// report such a figure (every OS but Linux).
///
/// # Portability
/// Linux only (3.14 and later); the BSDs and macOS return `None`.
pub fn available_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        parse_meminfo(&text)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// The parent process id of `pid`, from `/proc/PID/stat` on Linux. `None`
/// when the process is gone, or on systems without a readable `/proc`.
///
/// # Portability
/// Linux only; the BSDs and macOS return `None`.
pub fn parent_of(pid: u32) -> Option<u32> {
    #[cfg(target_os = "linux")]
    {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        parse_stat_ppid(&stat)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        None
    }
}

/// The parent pid field of a `/proc/PID/stat` line: the second field
/// after the command name, which may itself hold spaces and parentheses
/// (so the name ends at the *last* `)`).
pub fn parse_stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The listening sockets a service manager passed by the systemd
/// convention (`sd_listen_fds(3)`): when `LISTEN_PID` is this process and
/// `LISTEN_FDS` is N, descriptors 3 to 3 + N − 1. Each becomes
/// close-on-exec, and the three variables are removed from the
/// environment, so children do not take the sockets for theirs.
///
/// Returns an empty list when the variables are absent or meant for
/// another process.
///
/// # Errors
/// A malformed `LISTEN_FDS`, or a named descriptor that is not open.
///
/// # Safety of the adoption
/// The descriptors become `OwnedFd`s only after `fcntl(F_GETFD)` shows
/// each is open; this process is their only owner by the convention, and
/// this function adopts them at most once (the variables are removed).
pub fn listen_fds() -> io::Result<Vec<OwnedFd>> {
    const FIRST: i32 = 3;
    let for_us = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        == Some(std::process::id());
    let count = std::env::var("LISTEN_FDS").ok();
    std::env::remove_var("LISTEN_PID");
    std::env::remove_var("LISTEN_FDS");
    std::env::remove_var("LISTEN_FDNAMES");
    let Some(count) = count.filter(|_| for_us) else {
        return Ok(Vec::new());
    };
    let n: i32 = count.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("LISTEN_FDS={count:?} is not a number"),
        )
    })?;
    if !(0..=1024).contains(&n) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("LISTEN_FDS={n} is out of range"),
        ));
    }
    let mut fds = Vec::new();
    for fd in FIRST..FIRST + n {
        // SAFETY: fcntl on any integer is defined; it fails with EBADF for
        // a descriptor that is not open.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("LISTEN_FDS names descriptor {fd}: {e}"),
            ));
        }
        // SAFETY: as above; setting FD_CLOEXEC on an open descriptor.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor is open (checked above) and, by the
        // socket-activation convention, handed to this process alone; the
        // variables naming it are gone, so nothing adopts it twice.
        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_stat_parse() {
        let mem = "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n";
        assert_eq!(parse_meminfo(mem), Some(8_000_000 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
        let stat = "1234 (a (weird) name) S 777 1234 1234 0 -1";
        assert_eq!(parse_stat_ppid(stat), Some(777));
        assert_eq!(parse_stat_ppid("garbage"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_a_parent_and_the_machine_a_load() {
        assert_eq!(
            parent_of(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
        assert!(load_average().is_some_and(|l| l >= 0.0));
        assert!(available_memory().is_some_and(|m| m > 0));
    }
}
