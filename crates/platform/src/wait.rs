//! Every way a process can wait for a token on a shared pipe, behind one
//! small interface.
//!
//! A job-token pipe is shared by many processes. How many of them one
//! written byte wakes depends on how they wait; [`Mode`] names each way and
//! [`PipeWaiter`] waits in it; docs/ARCHITECTURE.md §2 has the measured
//! counts. [`FairWait`] is the one wait a jobserver client makes.
//!
//! The readiness modes (poll, select, epoll, kqueue) only learn that the
//! pipe is *probably* readable: by the time the woken process reads, another
//! may have taken the byte. The loop is therefore always
//!
//! ```no_run
//! # use herdless_platform::wait::{Mode, PipeWaiter, Woken};
//! # fn token(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u8> {
//! let mut waiter = PipeWaiter::new(fd, Mode::Poll)?;
//! loop {
//!     if let Some(byte) = waiter.try_claim()? {
//!         return Ok(byte);
//!     }
//!     if let Woken::Claimed(byte) = waiter.wait()? {
//!         return Ok(byte);
//!     }
//! }
//! # }
//! ```
//!
//! The futex mode does not wait on a pipe at all: it is the kernel's own
//! wake-one hand-off on a shared word, [`SharedWord`](crate::SharedWord),
//! kept in [`Mode`] so benchmarks can name it beside the others.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::str::FromStr;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::select::{select, FdSet, FD_SETSIZE};
use nix::sys::stat::fstat;

pub use crate::fair_wait::FairWait;
use crate::kernel::{kernel, Kernel};
use crate::sys;

/// A way to wait for a byte on a shared pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `poll(POLLIN)`, then a non-blocking read. Wakes every waiter.
    Poll,
    /// `select()` on a read set, then a non-blocking read. Wakes every
    /// waiter; only for descriptors below `FD_SETSIZE`.
    Select,
    /// One epoll instance per process, `EPOLLIN` (level or edge
    /// triggered, see [`Trigger`]). Wakes every waiter. Linux only.
    Epoll,
    /// One epoll instance per process, `EPOLLIN | EPOLLEXCLUSIVE`. Wakes one
    /// idle waiter, always the first registered one. Linux 4.5 and later.
    EpollExclusive,
    /// A blocking one-byte `read()`: the wait and the claim are one call.
    /// Wakes one waiter, in FIFO order, on Linux 5.6 and later; every
    /// waiter on earlier Linux and on the BSDs.
    BlockingRead,
    /// kqueue `EVFILT_READ` with `EV_CLEAR`. Wakes every waiter. BSD and
    /// Apple systems only.
    KqueueClear,
    /// kqueue `EVFILT_READ` with `EV_DISPATCH`, re-enabled before each wait.
    /// Wakes every waiter. BSD and Apple systems only.
    KqueueDispatch,
    /// A wake-one futex on a shared word (Linux `FUTEX_WAKE`, FreeBSD
    /// `_umtx_op(UMTX_OP_WAKE)`, NetBSD `__futex`). Not a pipe mode: see
    /// [`SharedWord`](crate::SharedWord).
    Futex,
}

impl Mode {
    /// Every mode, in declaration order.
    pub const ALL: [Mode; 8] = [
        Mode::Poll,
        Mode::Select,
        Mode::Epoll,
        Mode::EpollExclusive,
        Mode::BlockingRead,
        Mode::KqueueClear,
        Mode::KqueueDispatch,
        Mode::Futex,
    ];

    /// The mode's name, as [`FromStr`] accepts it: "poll", "select",
    /// "epoll", "epoll-exclusive", "blocking-read", "kqueue",
    /// "kqueue-dispatch", "futex".
    pub fn name(self) -> &'static str {
        match self {
            Mode::Poll => "poll",
            Mode::Select => "select",
            Mode::Epoll => "epoll",
            Mode::EpollExclusive => "epoll-exclusive",
            Mode::BlockingRead => "blocking-read",
            Mode::KqueueClear => "kqueue",
            Mode::KqueueDispatch => "kqueue-dispatch",
            Mode::Futex => "futex",
        }
    }

    /// Whether this OS and kernel offer the mode. Nothing is emulated: a
    /// mode the kernel lacks is reported, with the reason.
    ///
    /// # Errors
    ///
    /// [`Unavailable`] for epoll modes off Linux, `EpollExclusive` before
    /// Linux 4.5, kqueue modes off the BSDs and Apple systems, and `Futex`
    /// where no shared wake-one word is implemented (macOS, OpenBSD,
    /// DragonFly, NetBSD before 10).
    ///
    /// # Portability
    ///
    /// Reads the kernel release with `uname()` for the version checks;
    /// makes no other system call.
    pub fn available(self) -> Result<(), Unavailable> {
        self.available_on(&kernel())
    }

    pub(crate) fn available_on(self, kernel: &Kernel) -> Result<(), Unavailable> {
        match self {
            Mode::Poll | Mode::Select | Mode::BlockingRead => Ok(()),
            Mode::Futex => sys::futex_support(kernel),
            Mode::Epoll | Mode::EpollExclusive | Mode::KqueueClear | Mode::KqueueDispatch => {
                sys::mode_support(self, kernel)
            }
        }
        .map_err(|reason| Unavailable { mode: self, reason })
    }

    /// Whether the mode only reports readiness, so that a claim must follow
    /// each wake-up (everything but `BlockingRead` and `Futex`).
    pub fn is_readiness(self) -> bool {
        !matches!(self, Mode::BlockingRead | Mode::Futex)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = ParseModeError;

    fn from_str(s: &str) -> Result<Mode, ParseModeError> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| ParseModeError(s.to_owned()))
    }
}

/// A string that names no [`Mode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseModeError(String);

impl fmt::Display for ParseModeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown wait mode {:?}; expected one of ", self.0)?;
        for (i, m) in Mode::ALL.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{m}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ParseModeError {}

/// A wait mode this OS or kernel does not offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable {
    mode: Mode,
    reason: String,
}

impl Unavailable {
    /// The mode asked for.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Why the mode is missing, e.g. "EPOLLEXCLUSIVE needs Linux 4.5 or
    /// later; this is 4.4.0".
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wait mode {} is not available: {}",
            self.mode, self.reason
        )
    }
}

impl std::error::Error for Unavailable {}

impl From<Unavailable> for io::Error {
    fn from(e: Unavailable) -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, e)
    }
}

/// Level or edge triggering, for the epoll modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Trigger {
    /// Report the fd as long as it is readable.
    #[default]
    Level,
    /// `EPOLLET`: report the fd when new data arrives. A caller must call
    /// [`PipeWaiter::try_claim`] before each wait, or a byte that was
    /// already there when it started waiting goes unnoticed.
    Edge,
}

/// What ended a wait.
#[must_use = "a claimed byte is a job token; dropping it loses the token"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Woken {
    /// The pipe is probably readable (or at end of file): try
    /// [`PipeWaiter::try_claim`], and wait again if it finds nothing.
    Readable,
    /// `BlockingRead` mode read this byte: the caller now holds it.
    Claimed(u8),
    /// The deadline passed ([`FairWait`] only).
    TimedOut,
    /// A signal arrived (`EINTR`; [`FairWait`] only).
    Interrupted,
}

/// Waits on the read end of a shared pipe in one [`Mode`].
///
/// The waiter keeps its own duplicate of the descriptor (`F_DUPFD_CLOEXEC`,
/// sharing the open file description) and never changes the description's
/// flags, which every process sharing the pipe would see: GNU make before
/// 4.3 fails on `EAGAIN` when someone else makes its jobserver pipe
/// non-blocking.
///
/// Not `Clone`, and for the kqueue modes not usable in a child after
/// `fork()`: kqueue descriptors are not inherited (kqueue(2)).
#[derive(Debug)]
pub struct PipeWaiter {
    mode: Mode,
    /// Where the wait happens. For `BlockingRead` a blocking description.
    wait_fd: OwnedFd,
    /// A non-blocking description of the same pipe, if one could be had.
    claim_fd: Option<OwnedFd>,
    /// Whether `claim_fd` is a description of this waiter's own.
    claim_private: bool,
    how: How,
}

#[derive(Debug)]
enum How {
    Poll,
    Select,
    BlockingRead,
    Queue(sys::Poller),
}

impl PipeWaiter {
    /// Prepares to wait on the pipe read end `fd` in `mode`, level
    /// triggered. See [`PipeWaiter::with_trigger`].
    ///
    /// # Errors
    ///
    /// As [`PipeWaiter::with_trigger`].
    pub fn new(fd: BorrowedFd<'_>, mode: Mode) -> io::Result<PipeWaiter> {
        PipeWaiter::with_trigger(fd, mode, Trigger::Level)
    }

    /// `fcntl(F_DUPFD_CLOEXEC)`, then the mode's set-up (`epoll_create1()`
    /// and `epoll_ctl(EPOLL_CTL_ADD)`, or `kqueue()` and `kevent(EV_ADD)`),
    /// and where possible a private non-blocking description for
    /// [`try_claim`](PipeWaiter::try_claim).
    ///
    /// `trigger` applies to `Epoll` and `EpollExclusive` and is ignored by
    /// the other modes (`KqueueClear` is edge triggered by nature).
    ///
    /// # Errors
    ///
    /// - `Unsupported` (holding an [`Unavailable`]) when the OS lacks the
    ///   mode;
    /// - `InvalidInput` when `fd` is not a pipe or FIFO open for reading,
    ///   when `mode` is `Futex` (use [`SharedWord`](crate::SharedWord)),
    ///   when `mode` is `Select` and the duplicate is not below
    ///   `FD_SETSIZE`, or when `mode` is `BlockingRead`, the description
    ///   is non-blocking and no blocking one can be opened;
    /// - the OS error of any call made.
    ///
    /// # Portability
    ///
    /// The private non-blocking description is opened through
    /// `/proc/self/fd/N` on Linux, which gives a new open file description
    /// of the same pipe. No BSD can reopen an anonymous pipe; there the
    /// claim reads the waiter's own descriptor if the description already
    /// is non-blocking, and [`try_claim`](PipeWaiter::try_claim) reports
    /// `Unsupported` otherwise.
    pub fn with_trigger(
        fd: BorrowedFd<'_>,
        mode: Mode,
        trigger: Trigger,
    ) -> io::Result<PipeWaiter> {
        mode.available()?;
        if mode == Mode::Futex {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the futex mode waits on a SharedWord, not on a pipe",
            ));
        }
        check_readable_pipe(fd)?;
        let shared_nonblocking = is_nonblocking(fd)?;
        let private_nonblocking = sys::reopen_pipe(fd, true)?;
        let claim_private = private_nonblocking.is_some();
        let claim_fd = match private_nonblocking {
            Some(private) => Some(private),
            None if shared_nonblocking => Some(dup(fd)?),
            None => None,
        };
        let wait_fd = if mode == Mode::BlockingRead && shared_nonblocking {
            sys::reopen_pipe(fd, false)?.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "fd {} is non-blocking and this OS cannot open a blocking description \
                         of the pipe for the blocking-read mode",
                        fd.as_raw_fd()
                    ),
                )
            })?
        } else {
            dup(fd)?
        };
        let how = match mode {
            Mode::Poll => How::Poll,
            Mode::Select => {
                check_select_fd(wait_fd.as_raw_fd())?;
                How::Select
            }
            Mode::BlockingRead => How::BlockingRead,
            Mode::Epoll | Mode::EpollExclusive | Mode::KqueueClear | Mode::KqueueDispatch => {
                How::Queue(sys::Poller::new(wait_fd.as_fd(), mode, trigger)?)
            }
            Mode::Futex => unreachable!("rejected above"),
        };
        Ok(PipeWaiter {
            mode,
            wait_fd,
            claim_fd,
            claim_private,
            how,
        })
    }

    /// The mode this waiter waits in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Blocks until the pipe is probably readable, or, in `BlockingRead`
    /// mode, until this process has read a byte from it.
    ///
    /// Calls `poll()`, `select()`, `epoll_wait()`, `kevent()` or `read()`,
    /// by mode. A signal that interrupts the call (`EINTR`) is retried
    /// here, so a caller that must act on signals should use
    /// [`wait_interruptible`](PipeWaiter::wait_interruptible) instead. No
    /// timeout is involved, ever.
    ///
    /// A pipe with no writer left reads as readable forever; the following
    /// [`try_claim`](PipeWaiter::try_claim) reports the end of file.
    ///
    /// # Errors
    ///
    /// - `UnexpectedEof` in `BlockingRead` mode when every write end is
    ///   closed;
    /// - the OS error of the call.
    ///
    /// # Portability
    ///
    /// On Linux 5.6 and later a blocking read of an empty pipe is an
    /// exclusive wait (commit 0ddad21d3e99, "pipe: use exclusive waits when
    /// reading or writing"): one byte wakes one reader, in FIFO order. A
    /// reader woken by a byte but then interrupted by a signal gives up the
    /// wake-up; the kernel then wakes the next reader only if the byte is
    /// still there when the woken one leaves `pipe_read()`. On earlier
    /// Linux and on the BSDs every blocked reader wakes and all but one go
    /// back to sleep.
    ///
    /// `EpollExclusive` wakes "one or more" waiters (epoll_ctl(2)): the
    /// wait entries are queued on the pipe once, at `EPOLL_CTL_ADD`, so the
    /// first-registered process that is idle in `epoll_wait()` wins every
    /// time — a stack, not a queue; a busy first waiter lets the wake-up
    /// fall through to the next, and more than one can wake.
    pub fn wait(&mut self) -> io::Result<Woken> {
        loop {
            match self.wait_interruptible() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// As [`wait`](PipeWaiter::wait), but returns an `Interrupted` error
    /// when a signal interrupts the call, so the caller can act on it
    /// (a `SIGCHLD` handler's flag, say) before waiting again.
    ///
    /// # Errors
    ///
    /// As [`wait`](PipeWaiter::wait), plus `Interrupted`.
    pub fn wait_interruptible(&mut self) -> io::Result<Woken> {
        match &mut self.how {
            How::Poll => {
                let mut fds = [PollFd::new(self.wait_fd.as_fd(), PollFlags::POLLIN)];
                poll(&mut fds, PollTimeout::NONE)?;
                if fds[0]
                    .revents()
                    .is_some_and(|r| r.contains(PollFlags::POLLNVAL))
                {
                    return Err(Errno::EBADF.into());
                }
                Ok(Woken::Readable)
            }
            How::Select => {
                let mut set = FdSet::new();
                set.insert(self.wait_fd.as_fd());
                select(None, &mut set, None, None, None)?;
                Ok(Woken::Readable)
            }
            How::BlockingRead => {
                let mut byte = [0u8; 1];
                match nix::unistd::read(&self.wait_fd, &mut byte)? {
                    0 => Err(eof()),
                    _ => Ok(Woken::Claimed(byte[0])),
                }
            }
            How::Queue(poller) => {
                poller.wait()?;
                Ok(Woken::Readable)
            }
        }
    }

    /// Reads one byte without blocking: `Some(byte)` if this process got
    /// it, `None` if the pipe is empty (another process took the byte that
    /// woke us, or nothing was written).
    ///
    /// Calls `read()` on a non-blocking description of the pipe; the
    /// description the waiter blocks on is never made non-blocking, so this
    /// works in `BlockingRead` mode too. `EINTR` is retried.
    ///
    /// # Errors
    ///
    /// - `UnexpectedEof` when every write end is closed and the pipe is
    ///   empty;
    /// - `Unsupported` where the OS cannot open a private non-blocking
    ///   description and the shared one is blocking (see `# Portability`);
    /// - the OS error of `read()`.
    ///
    /// # Portability
    ///
    /// Linux: a private description opened through `/proc/self/fd/N` with
    /// `O_NONBLOCK` (proc(5): opening the entry of a pipe opens the pipe
    /// itself, like opening a FIFO). BSD and Apple systems: the shared
    /// description, only if it is already non-blocking. Polling with a zero
    /// timeout and then reading a blocking descriptor is not offered: a
    /// competitor can empty the pipe between the two calls and the read
    /// then blocks.
    pub fn try_claim(&self) -> io::Result<Option<u8>> {
        let Some(fd) = &self.claim_fd else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "cannot read the pipe without blocking: its description is blocking and \
                 this OS cannot open a private non-blocking one; pass a non-blocking \
                 descriptor",
            ));
        };
        let mut byte = [0u8; 1];
        let n = loop {
            match nix::unistd::read(fd, &mut byte) {
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Ok(None),
                other => break other?,
            }
        };
        match n {
            0 => Err(eof()),
            _ => Ok(Some(byte[0])),
        }
    }

    /// Whether [`try_claim`](PipeWaiter::try_claim) reads a description of
    /// its own (`true`), or the one shared with other processes (`false`,
    /// also when it cannot claim at all).
    pub fn has_private_claim(&self) -> bool {
        self.claim_private
    }
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the token pipe is closed: no write end is left open",
    )
}

/// `fcntl(F_DUPFD_CLOEXEC)`: a new descriptor, same open file description.
fn dup(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    fd.try_clone_to_owned()
}

fn is_nonblocking(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
    Ok(flags.contains(OFlag::O_NONBLOCK))
}

fn check_readable_pipe(fd: BorrowedFd<'_>) -> io::Result<()> {
    let st = fstat(fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fd {} is not a pipe or FIFO", fd.as_raw_fd()),
        ));
    }
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
    if (flags & OFlag::O_ACCMODE) == OFlag::O_WRONLY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "fd {} is the write end of a pipe, not open for reading",
                fd.as_raw_fd()
            ),
        ));
    }
    Ok(())
}

/// `FD_SET` on a descriptor at or above `FD_SETSIZE` writes past the set;
/// nix asserts against it, and this turns the assertion into an error.
pub(crate) fn check_select_fd(fd: RawFd) -> io::Result<()> {
    match usize::try_from(fd) {
        Ok(n) if n < FD_SETSIZE => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("select cannot watch fd {fd}: it is not below FD_SETSIZE ({FD_SETSIZE})"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for mode in Mode::ALL {
            assert_eq!(mode.name().parse::<Mode>(), Ok(mode));
            assert_eq!(mode.to_string(), mode.name());
        }
        let names: Vec<_> = Mode::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(
            names,
            [
                "poll",
                "select",
                "epoll",
                "epoll-exclusive",
                "blocking-read",
                "kqueue",
                "kqueue-dispatch",
                "futex"
            ]
        );
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = "epol".parse::<Mode>().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("\"epol\""), "{text}");
        assert!(text.contains("epoll-exclusive, blocking-read"), "{text}");
    }

    #[test]
    fn select_limit() {
        assert!(check_select_fd(0).is_ok());
        assert!(check_select_fd(FD_SETSIZE as RawFd - 1).is_ok());
        let err = check_select_fd(FD_SETSIZE as RawFd).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(check_select_fd(-1).is_err());
    }

    #[test]
    fn epoll_exclusive_follows_the_release() {
        let old = Kernel {
            sysname: "Linux".into(),
            release: "4.4.0".into(),
        };
        let new = Kernel {
            sysname: "Linux".into(),
            release: "4.5.0".into(),
        };
        if cfg!(target_os = "linux") {
            let why = Mode::EpollExclusive.available_on(&old).unwrap_err();
            assert!(why.reason().contains("4.4.0"), "{why}");
            assert_eq!(Mode::EpollExclusive.available_on(&new), Ok(()));
        } else {
            assert!(Mode::EpollExclusive.available_on(&new).is_err());
        }
    }

    #[test]
    fn unavailable_is_an_unsupported_io_error() {
        let why = Unavailable {
            mode: Mode::KqueueClear,
            reason: "not here".into(),
        };
        let err = io::Error::from(why);
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
        assert_eq!(
            err.to_string(),
            "wait mode kqueue is not available: not here"
        );
    }
}
