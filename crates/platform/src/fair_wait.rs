//! One wait for a token on a pipe shared with other processes, waking as
//! few of them as the OS allows, longest waiter first.
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
//! the process that registered first: docs/ARCHITECTURE.md §2.)
//!
//! Why not the blocking `read()`, which Linux ≥ 5.6 also wakes one at a
//! time, in FIFO order? It cannot have a deadline without a timer or a
//! signal; a signal that interrupts it after the kernel chose it swallows
//! the wake-up, and the next waiter is woken only if the byte is still
//! there when the first leaves; it needs a blocking description, which a
//! client must never make of a shared pipe; and a caller's own poll loop
//! cannot watch it. With epoll the claim is a separate non-blocking read
//! that follows *every* return from the wait — an event, a timeout or
//! `EINTR` alike — so a wake-up aimed at this process is never dropped:
//! either it finds the byte, or another process already has it.
//!
//! One write wakes one exclusive waiter however many bytes it carries: a
//! caller that claims a byte and finds more in the pipe must pass the
//! wake-up on (take one more byte and write it back), or the other waiters
//! sleep on with tokens free.
//!
//! Elsewhere: `poll()`. FreeBSD, NetBSD and macOS wake every process that
//! waits on a pipe, whatever the call (kqueue has no exclusive mode), so
//! the portable call costs nothing more.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use crate::wait::Woken;

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
    #[derive(Debug)]
    pub struct FairWait {
        epoll: Epoll,
    }

    impl FairWait {
        /// Registers `pipe` exclusively and `extra` (a private notification
        /// pipe, or any descriptor only this process waits on) normally.
        ///
        /// # Errors
        ///
        /// Those of `epoll_create1` and `epoll_ctl`.
        pub fn new(pipe: BorrowedFd<'_>, extra: Option<BorrowedFd<'_>>) -> io::Result<FairWait> {
            let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
            epoll.add(
                pipe,
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLEXCLUSIVE, 0),
            )?;
            if let Some(fd) = extra {
                epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1))?;
            }
            Ok(FairWait { epoll })
        }

        /// One `epoll_wait()`: `Readable`, `TimedOut` or `Interrupted`.
        ///
        /// # Errors
        ///
        /// Those of `epoll_wait` other than `EINTR`.
        pub fn wait(&self, deadline: Option<Instant>) -> io::Result<Woken> {
            let timeout = match millis_left(deadline) {
                None => EpollTimeout::NONE,
                Some(ms) => EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::MAX),
            };
            let mut events = [EpollEvent::empty(); 2];
            match self.epoll.wait(&mut events, timeout) {
                Ok(0) => Ok(Woken::TimedOut),
                Ok(_) => Ok(Woken::Readable),
                Err(Errno::EINTR) => Ok(Woken::Interrupted),
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
    #[derive(Debug)]
    pub struct FairWait {
        pipe: OwnedFd,
        extra: Option<OwnedFd>,
    }

    impl FairWait {
        /// Keeps duplicates of `pipe` and `extra` to poll.
        ///
        /// # Errors
        ///
        /// Those of `fcntl(F_DUPFD_CLOEXEC)`.
        pub fn new(pipe: BorrowedFd<'_>, extra: Option<BorrowedFd<'_>>) -> io::Result<FairWait> {
            Ok(FairWait {
                pipe: pipe.try_clone_to_owned()?,
                extra: extra.map(|e| e.try_clone_to_owned()).transpose()?,
            })
        }

        /// One `poll()`: `Readable`, `TimedOut` or `Interrupted`.
        ///
        /// # Errors
        ///
        /// Those of `poll` other than `EINTR`.
        pub fn wait(&self, deadline: Option<Instant>) -> io::Result<Woken> {
            let timeout = match millis_left(deadline) {
                None => PollTimeout::NONE,
                Some(ms) => PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            };
            let mut fds = vec![PollFd::new(self.pipe.as_fd(), PollFlags::POLLIN)];
            if let Some(e) = &self.extra {
                fds.push(PollFd::new(e.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(0) => Ok(Woken::TimedOut),
                Ok(_) => Ok(Woken::Readable),
                Err(Errno::EINTR) => Ok(Woken::Interrupted),
                Err(e) => Err(e.into()),
            }
        }
    }
}

pub use imp::FairWait;
