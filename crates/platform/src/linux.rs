//! Linux backend: `SO_PEERCRED`, `/proc`, epoll and futex.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::ptr;
use std::sync::atomic::AtomicU32;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use crate::cred::PeerCred;
use crate::kernel::Kernel;
use crate::usage::{parse_proc_status, CtxSwitches};
use crate::wait::{Mode, Trigger};

pub(crate) fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let cred = getsockopt(&fd, PeerCredentials)?;
    // unix(7): the pid is 0 when the peer is in a pid namespace we cannot
    // see into.
    let pid = cred.pid();
    Ok(PeerCred {
        uid: cred.uid(),
        pid: (pid > 0).then_some(pid),
    })
}

pub(crate) fn process_ctx_switches(pid: i32) -> io::Result<CtxSwitches> {
    if pid <= 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("pid {pid} is not a process id"),
        ));
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_proc_status(&status)
}

/// Linux 5.6 made blocking pipe reads exclusive waits (commit
/// 0ddad21d3e99, "pipe: use exclusive waits when reading or writing"):
/// before it, every reader blocked on an empty pipe woke for each byte.
pub(crate) fn exclusive_pipe_read(kernel: &Kernel) -> bool {
    kernel.at_least(5, 6)
}

pub(crate) fn mode_support(mode: Mode, kernel: &Kernel) -> Result<(), String> {
    match mode {
        Mode::Epoll => Ok(()),
        // EPOLLEXCLUSIVE arrived in Linux 4.5 (commit df0108c5da56, "epoll:
        // add EPOLLEXCLUSIVE flag"). Earlier kernels ignore unknown event
        // bits in epoll_ctl(), so trying it cannot tell: the version can.
        Mode::EpollExclusive if kernel.at_least(4, 5) => Ok(()),
        Mode::EpollExclusive => Err(format!(
            "EPOLLEXCLUSIVE needs Linux 4.5 or later; this is {}",
            kernel.release
        )),
        Mode::KqueueClear | Mode::KqueueDispatch => {
            Err("kqueue is a BSD and Apple interface; Linux has epoll".to_owned())
        }
        Mode::Poll | Mode::Select | Mode::BlockingRead | Mode::Futex => Ok(()),
    }
}

/// `FUTEX_WAIT`/`FUTEX_WAKE` without `FUTEX_PRIVATE_FLAG`: the kernel keys
/// a shared futex on the mapped file and offset, so processes that map the
/// same file meet on the same word (futex(2)). Present since 2.6.0.
pub(crate) fn futex_support(_kernel: &Kernel) -> Result<(), String> {
    Ok(())
}

/// Sleeps while `*word == expected`. Returns `Ok` on a wake-up, on a
/// spurious return and when the word no longer holds `expected`
/// (`EAGAIN`); the caller re-checks the word in every case.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32) -> io::Result<()> {
    futex_wait_for(word, expected, None).map(drop)
}

/// [`futex_wait`] for at most `timeout`: `Ok(false)` when it ran out. A
/// wait with a timeout is never restarted after a signal handler: it
/// fails with `Interrupted`.
pub(crate) fn futex_wait_for(
    word: &AtomicU32,
    expected: u32,
    timeout: Option<std::time::Duration>,
) -> io::Result<bool> {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    });
    let tp = ts
        .as_ref()
        .map_or(ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, aligned 32-bit word for the whole call.
    // FUTEX_WAIT reads it and the timeout, which is null or a timespec that
    // outlives the call (relative, for this op); uaddr2 and val3 are
    // ignored by this op.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            tp,
            ptr::null::<u32>(),
            0u32,
        )
    };
    if rc == -1 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EAGAIN) => Ok(true),
            Some(libc::ETIMEDOUT) => Ok(false),
            _ => Err(err),
        };
    }
    Ok(true)
}

/// Wakes at most `n` processes sleeping on `word`; the kernel picks the
/// longest waiters of the highest priority (FIFO among equals).
fn futex_wake(word: &AtomicU32, n: i32) -> io::Result<()> {
    // SAFETY: `word` is a live, aligned 32-bit word. FUTEX_WAKE only uses
    // its address as a key and dereferences none of the other arguments.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0u32,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Wakes at most one process sleeping in [`futex_wait`] on `word`.
pub(crate) fn futex_wake_one(word: &AtomicU32) -> io::Result<()> {
    futex_wake(word, 1)
}

/// Wakes every process sleeping on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) -> io::Result<()> {
    futex_wake(word, i32::MAX)
}

/// Opens a new open file description of the pipe behind `fd` through
/// `/proc/self/fd/N`. Opening a pipe's proc entry runs the FIFO open path
/// on the same pipe, so the new description has flags of its own and
/// changing them touches no other process (proc(5)).
///
/// The open is always non-blocking, because a blocking open of a pipe
/// with no writer waits for one (fifo(7)); a blocking description is made
/// by clearing `O_NONBLOCK` on the new, private description afterwards.
///
/// `Ok(None)` when `/proc` is not mounted or the entry cannot be opened.
pub(crate) fn reopen_pipe(fd: BorrowedFd<'_>, nonblocking: bool) -> io::Result<Option<OwnedFd>> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(file) => file,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::EACCES | libc::ENXIO)
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let fd = OwnedFd::from(file);
    if !nonblocking {
        let flags = OFlag::from_bits_retain(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))?;
    }
    Ok(Some(fd))
}

/// One epoll instance, watching one pipe. Each waiting process has its
/// own, as a sub-make would: an epoll fd shared by processes would hand
/// each event to one of them, which is a different experiment.
#[derive(Debug)]
pub(crate) struct Poller {
    epoll: Epoll,
}

impl Poller {
    pub(crate) fn new(fd: BorrowedFd<'_>, mode: Mode, trigger: Trigger) -> io::Result<Poller> {
        let mut flags = match mode {
            Mode::Epoll => EpollFlags::EPOLLIN,
            // EPOLLEXCLUSIVE is only accepted with EPOLL_CTL_ADD, and only
            // beside EPOLLIN, EPOLLOUT, EPOLLWAKEUP and EPOLLET
            // (epoll_ctl(2)).
            Mode::EpollExclusive => EpollFlags::EPOLLIN | EpollFlags::EPOLLEXCLUSIVE,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{other} is not an epoll mode"),
                ))
            }
        };
        if trigger == Trigger::Edge {
            flags |= EpollFlags::EPOLLET;
        }
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(fd, EpollEvent::new(flags, 0))?;
        Ok(Poller { epoll })
    }

    /// `epoll_wait()` for one event, without a timeout. `EINTR` comes back
    /// to the caller as an `Interrupted` error.
    pub(crate) fn wait(&mut self) -> io::Result<()> {
        let mut events = [EpollEvent::empty()];
        while self.epoll.wait(&mut events, EpollTimeout::NONE)? == 0 {}
        Ok(())
    }
}

/// A descriptor that turns readable once process `pid` has exited: a pidfd
/// (`pidfd_open`, Linux 5.3), close-on-exec.
pub(crate) fn process_exit_fd(pid: u32) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes a pid and a flags word and passes no memory;
    // it returns a new descriptor or -1 with errno set.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: `fd` is a descriptor the kernel just made for this process,
    // owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
