//! The descriptor limit (`RLIMIT_NOFILE`) of a process that serves many
//! connections.
//!
//! A broker holds one descriptor per client, and a build may start more
//! clients at once than the usual soft limit of 1024. As Go's runtime and
//! many servers do, the broker raises its soft limit to the hard limit at
//! start; the commands it runs get the soft limit back, since programs
//! built around `select(2)` cannot use descriptors past 1023.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// `OPEN_MAX` of Apple's `<sys/syslimits.h>`, which the `libc` crate does
/// not define for Apple targets: `setrlimit(RLIMIT_NOFILE)` refuses a soft
/// limit above it even when the hard limit is unlimited (setrlimit(2)).
#[cfg(any(target_os = "macos", target_os = "ios"))]
const APPLE_OPEN_MAX: u64 = 10240;

/// The descriptor limits before and after [`raise_nofile_limit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NofileLimit {
    /// The soft limit this process started with.
    pub original: u64,
    /// The soft limit now.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit (on Apple
/// systems to at most `OPEN_MAX`, which the kernel enforces below an
/// unlimited hard limit). A failure leaves the limit as it was.
// rlim_t is u64 on Linux and Apple systems, i64 on the BSDs.
#[allow(clippy::unnecessary_cast)]
pub fn raise_nofile_limit() -> io::Result<NofileLimit> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let (soft, hard) = (soft as u64, hard as u64);
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    let target = hard.min(APPLE_OPEN_MAX);
    #[cfg(not(any(target_os = "macos", target_os = "ios")))]
    let target = hard;
    if target <= soft {
        return Ok(NofileLimit {
            original: soft,
            soft,
            hard,
        });
    }
    setrlimit(
        Resource::RLIMIT_NOFILE,
        target as libc::rlim_t,
        hard as libc::rlim_t,
    )?;
    Ok(NofileLimit {
        original: soft,
        soft: target,
        hard,
    })
}

/// Makes `cmd`'s process start with the soft descriptor limit `soft` (the
/// one this process had before [`raise_nofile_limit`]).
pub fn child_nofile_limit(cmd: &mut Command, limit: NofileLimit) {
    if limit.soft == limit.original {
        return;
    }
    let rlim = libc::rlimit {
        rlim_cur: limit.original as libc::rlim_t,
        rlim_max: limit.hard as libc::rlim_t,
    };
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed; it makes one `setrlimit`
    // system call on a value captured by copy, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // SAFETY: `rlim` is a valid, initialised rlimit for the call.
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rlim) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Whether at least `n` file descriptors are free in this process: it
/// opens `/dev/null` and duplicates it until `n` are open, then closes
/// them all again (one open and `n - 1` duplications; about 30 µs for 135
/// on Linux). A failure other than a full table (to open `/dev/null`, say)
/// counts as room: the caller's own next open would tell.
pub fn descriptors_free(n: usize) -> bool {
    if n == 0 {
        return true;
    }
    let full = |e: io::Error| !matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    let first = match std::fs::File::open("/dev/null") {
        Ok(f) => f,
        Err(e) => return full(e),
    };
    let mut open = Vec::with_capacity(n.min(4096));
    while open.len() + 1 < n {
        match first.try_clone() {
            Ok(f) => open.push(f),
            Err(e) => return full(e),
        }
    }
    true
}
