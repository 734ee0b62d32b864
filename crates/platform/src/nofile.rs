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

/// Whether at least `n` file descriptors are free in this process.
///
/// Where the kernel tells how many are open (Linux's `/proc/self/fd`,
/// FreeBSD's `kern.proc.nfds`), the answer is the limit less that count,
/// and the check holds at most one descriptor for a moment (Linux: the
/// directory it reads); a [`DescriptorCount`] kept open holds none.
/// Elsewhere it opens `/dev/null` and duplicates it until `n` are open,
/// then closes them all again, holding `n` for that moment. A failure
/// other than a full table (to open `/dev/null`, say) counts as room: the
/// caller's own next open would tell. The count does not see the
/// system-wide table (`ENFILE`); the caller's open does.
pub fn descriptors_free(n: usize) -> bool {
    DescriptorCount::transient().free(n)
}

/// Counts this process's open descriptors for [`descriptors_free`]
/// again and again: on Linux it keeps `/proc/self/fd` open, so that a
/// count opens nothing, and another thread of the process (a make's main
/// thread, beside a broker's thread that checks room for each new client)
/// never finds the table full because of it. Its own descriptor is one of
/// those counted. Not for a fork: there it would count its parent's.
pub struct DescriptorCount {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    dir: Option<nix::dir::Dir>,
}

impl DescriptorCount {
    /// Opens what the counts read, where there is something to open.
    pub fn new() -> DescriptorCount {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            DescriptorCount { dir: open_fd_dir() }
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            DescriptorCount {}
        }
    }

    /// One that opens what it reads for each count.
    fn transient() -> DescriptorCount {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            DescriptorCount { dir: None }
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            DescriptorCount {}
        }
    }

    /// Whether at least `n` descriptors are free ([`descriptors_free`]).
    pub fn free(&mut self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let Some(limit) = descriptor_limit() else {
            return descriptors_free_by_opening(n);
        };
        match self.open_below(limit) {
            Some(open) => limit.saturating_sub(open) >= n as u64,
            None => descriptors_free_by_opening(n),
        }
    }

    /// How many descriptors numbered below `limit` this process has open
    /// (those above it, left from before the limit was lowered, take no
    /// room): the entries of `/proc/self/fd`, less the directory's own
    /// when it was opened only for this count.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn open_below(&mut self, limit: u64) -> Option<u64> {
        let kept = self.dir.is_some();
        let mut opened;
        let dir = match self.dir.as_mut() {
            Some(dir) => dir,
            None => {
                opened = open_fd_dir()?;
                &mut opened
            }
        };
        let own = u64::try_from(std::os::fd::AsRawFd::as_raw_fd(&*dir)).ok()?;
        let mut n: u64 = 0;
        // The iterator rewinds the directory when it is dropped.
        for entry in dir.iter() {
            let entry = entry.ok()?;
            let Some(fd) = std::str::from_utf8(entry.file_name().to_bytes())
                .ok()
                .and_then(|name| name.parse::<u64>().ok())
            else {
                continue;
            };
            // The directory's own descriptor counts when it is kept.
            if fd < limit && (kept || fd != own) {
                n += 1;
            }
        }
        Some(n)
    }

    /// How many descriptors this process has open (`kern.proc.nfds`):
    /// all of them, so that where some lie above a lowered limit fewer
    /// are counted free than are.
    #[cfg(target_os = "freebsd")]
    fn open_below(&mut self, _limit: u64) -> Option<u64> {
        let mib = [libc::CTL_KERN, libc::KERN_PROC, libc::KERN_PROC_NFDS, 0];
        let mut n: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>();
        // SAFETY: `mib` names four valid integers, `n` and `len` are valid
        // for writing and `len` is `n`'s size; nothing is written to the
        // kernel (null new value, length 0).
        let rc = unsafe {
            libc::sysctl(
                mib.as_ptr(),
                mib.len() as libc::c_uint,
                (&mut n as *mut libc::c_int).cast(),
                &mut len,
                std::ptr::null(),
                0,
            )
        };
        (rc == 0 && len == std::mem::size_of::<libc::c_int>())
            .then(|| u64::try_from(n).ok())
            .flatten()
    }

    /// The kernel does not tell here: counted by opening.
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    fn open_below(&mut self, _limit: u64) -> Option<u64> {
        None
    }
}

impl Default for DescriptorCount {
    fn default() -> Self {
        DescriptorCount::new()
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn open_fd_dir() -> Option<nix::dir::Dir> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::Mode;
    nix::dir::Dir::open(
        "/proc/self/fd",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

/// The most descriptors this process may have open: its soft
/// `RLIMIT_NOFILE`, and on FreeBSD `kern.maxfilesperproc` if lower.
// rlim_t is u64 on Linux and Apple systems, i64 on the BSDs.
#[allow(clippy::unnecessary_cast)]
fn descriptor_limit() -> Option<u64> {
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    let soft = soft as u64;
    #[cfg(target_os = "freebsd")]
    {
        let mut max: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>();
        // SAFETY: the name is a NUL-terminated string, `max` and `len`
        // are valid for writing and `len` is `max`'s size; nothing is
        // written to the kernel (null new value, length 0).
        let rc = unsafe {
            libc::sysctlbyname(
                c"kern.maxfilesperproc".as_ptr(),
                (&mut max as *mut libc::c_int).cast(),
                &mut len,
                std::ptr::null(),
                0,
            )
        };
        if rc == 0 && len == std::mem::size_of::<libc::c_int>() && max > 0 {
            return Some(soft.min(max as u64));
        }
    }
    Some(soft)
}

/// [`descriptors_free`] by opening them: `/dev/null` opened and
/// duplicated until `n` are open, then all closed (one open and `n - 1`
/// duplications; about 30 µs for 135 on Linux).
pub fn descriptors_free_by_opening(n: usize) -> bool {
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

/// Makes sure descriptors 0, 1 and 2 are open: each one that is closed is
/// opened on `/dev/null` (read and write, kept across `exec`), so that a
/// descriptor opened later (a socket, a FIFO, a directory) never takes a
/// standard stream's number and receives what the program writes to
/// stderr, or hands it what the program reads. A program started with
/// `2>&-` would otherwise write its messages into whatever it opened
/// first. Errors other than the descriptor being closed are returned,
/// and so is a failure to open `/dev/null` (a chroot without it).
pub fn open_standard_fds() -> io::Result<()> {
    for fd in 0..=2 {
        loop {
            // SAFETY: F_GETFD only reads the flags of descriptor `fd`; an
            // unused number gives EBADF.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBADF) {
                return Err(e);
            }
            // SAFETY: a NUL-terminated path; `open` returns a new
            // descriptor, the lowest free one, or -1.
            let got = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
            if got == -1 {
                return Err(io::Error::last_os_error());
            }
            if got > 2 {
                // Another thread took the number meanwhile: its own now.
                // SAFETY: `got` was opened just above and nothing else
                // knows it.
                unsafe { libc::close(got) };
                break;
            }
            // `got` is `fd`, or a lower standard one closed meanwhile (kept:
            // it is a standard stream too); look at `fd` again.
        }
    }
    Ok(())
}
