//! Waiting for a byte on the shared pipe, waking as few processes as the
//! OS allows.
//!
//! # Implementation notes
//!
//! Linux: one epoll instance per wait, with the pipe registered
//! `EPOLLIN | EPOLLEXCLUSIVE` (Linux ≥ 4.5; earlier kernels ignore the
//! flag and the wait is an ordinary, herd-waking one). A written byte wakes
//! one process that is idle in `epoll_wait()` (epoll_ctl(2)). The kernel
//! queues exclusive entries at the tail of the pipe's wait queue and wakes
//! from its head, so with one registration *per wait* — made when the wait
//! starts, dropped when it ends — the longest waiter is woken first. (A
//! registration kept for a process's lifetime would instead always favour
//! the process that registered first, DESIGN §2.)
//!
//! Why not the blocking `read()`, which Linux ≥ 5.6 also wakes one at a
//! time, in FIFO order? It cannot have a deadline without a timer or a
//! signal; a signal that interrupts it after the kernel chose it swallows
//! the wake-up, and the next waiter is woken only if the byte is still
//! there when the first leaves; it needs a blocking description, which is
//! the one thing this client never makes of a shared pipe; and a caller's
//! own poll loop cannot watch it. With epoll the claim is a separate
//! non-blocking read that follows *every* return from the wait — an event,
//! a timeout or `EINTR` alike — so a wake-up aimed at this process is never
//! dropped: either it finds the byte, or another process already has it.
//!
//! Elsewhere: `poll()`. FreeBSD, NetBSD and macOS wake every process that
//! waits on a pipe, whatever the call (kqueue has no exclusive mode), so
//! the portable call costs nothing more.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Instant;

/// How one wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Woke {
    /// Something is (probably) readable: claim, then wait again.
    Ready,
    /// The deadline passed.
    TimedOut,
    /// A signal arrived (`EINTR`).
    Interrupted,
}

/// Milliseconds left until `deadline`, rounded up so that a sub-millisecond
/// remainder still waits; `None` for no deadline.
fn millis_left(deadline: Option<Instant>) -> Option<u32> {
    deadline.map(|d| {
        let left = d.saturating_duration_since(Instant::now());
        left.as_micros().div_ceil(1000).min(i32::MAX as u128) as u32
    })
}

#[cfg(target_os = "linux")]
mod imp {
    use super::*;
    use nix::errno::Errno;
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

    /// One wait's epoll instance.
    pub(crate) struct Waiter {
        epoll: Epoll,
    }

    impl Waiter {
        /// Registers `pipe` exclusively and `extra` (a private notification
        /// pipe) normally.
        pub(crate) fn new(
            pipe: BorrowedFd<'_>,
            extra: Option<BorrowedFd<'_>>,
        ) -> io::Result<Waiter> {
            let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
            epoll.add(
                pipe,
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLEXCLUSIVE, 0),
            )?;
            if let Some(fd) = extra {
                epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1))?;
            }
            Ok(Waiter { epoll })
        }

        /// One `epoll_wait()`.
        pub(crate) fn wait(&self, deadline: Option<Instant>) -> io::Result<Woke> {
            let timeout = match millis_left(deadline) {
                None => EpollTimeout::NONE,
                Some(ms) => EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::MAX),
            };
            let mut events = [EpollEvent::empty(); 2];
            match self.epoll.wait(&mut events, timeout) {
                Ok(0) => Ok(Woke::TimedOut),
                Ok(_) => Ok(Woke::Ready),
                Err(Errno::EINTR) => Ok(Woke::Interrupted),
                Err(e) => Err(e.into()),
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::*;
    use nix::errno::Errno;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::{AsFd, OwnedFd};

    /// The descriptors one wait polls.
    pub(crate) struct Waiter {
        pipe: OwnedFd,
        extra: Option<OwnedFd>,
    }

    impl Waiter {
        pub(crate) fn new(
            pipe: BorrowedFd<'_>,
            extra: Option<BorrowedFd<'_>>,
        ) -> io::Result<Waiter> {
            Ok(Waiter {
                pipe: pipe.try_clone_to_owned()?,
                extra: extra.map(|e| e.try_clone_to_owned()).transpose()?,
            })
        }

        /// One `poll()`.
        pub(crate) fn wait(&self, deadline: Option<Instant>) -> io::Result<Woke> {
            let timeout = match millis_left(deadline) {
                None => PollTimeout::NONE,
                Some(ms) => PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            };
            let mut fds = vec![PollFd::new(self.pipe.as_fd(), PollFlags::POLLIN)];
            if let Some(e) = &self.extra {
                fds.push(PollFd::new(e.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(0) => Ok(Woke::TimedOut),
                Ok(_) => Ok(Woke::Ready),
                Err(Errno::EINTR) => Ok(Woke::Interrupted),
                Err(e) => Err(e.into()),
            }
        }
    }
}

pub(crate) use imp::Waiter;
