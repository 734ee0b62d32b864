//! BSD backend: FreeBSD, NetBSD, OpenBSD, DragonFly and Apple systems, which
//! share kqueue.
//!
//! This file cannot be compiled on the Linux machines the project is
//! developed on; every ABI detail comes from the `libc` and `nix` crates'
//! definitions for the target, never from hand-written structs.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;

use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::sys::event::{EvFlags, EventFilter, FilterFlag, KEvent, Kqueue};

use crate::cred::PeerCred;
use crate::kernel::Kernel;
use crate::usage::CtxSwitches;
use crate::wait::{Mode, Trigger};

pub(crate) fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let (uid, _gid) = nix::unistd::getpeereid(fd)?;
    Ok(PeerCred {
        uid: uid.as_raw(),
        pid: peer_pid(fd)?,
    })
}

/// FreeBSD: `LOCAL_PEERCRED` fills `xucred.cr_pid` since FreeBSD 13; older
/// kernels leave the union's pointer member zeroed, which reads as pid 0.
/// nix's `XuCred` does not expose the pid, so the call is made here.
#[cfg(target_os = "freebsd")]
fn peer_pid(fd: BorrowedFd<'_>) -> io::Result<Option<i32>> {
    // SAFETY: xucred is plain old data; all-zero bytes are a valid value.
    let mut cred: libc::xucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::xucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the size
    // of `cred`, as getsockopt(2) requires; `fd` is a live descriptor.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_LOCAL,
            libc::LOCAL_PEERCRED,
            (&mut cred as *mut libc::xucred).cast(),
            &mut len,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    if cred.cr_version != libc::XUCRED_VERSION {
        return Ok(None);
    }
    // SAFETY: both union members are plain integers or pointers of which the
    // kernel zeroed or set the whole; reading the pid member of any bit
    // pattern is defined.
    let pid = unsafe { cred.cr_pid__c_anonymous_union.cr_pid };
    Ok((pid > 0).then_some(pid))
}

/// macOS/iOS: `LOCAL_PEERPID` (since Mac OS X 10.8).
#[cfg(any(target_os = "macos", target_os = "ios"))]
fn peer_pid(fd: BorrowedFd<'_>) -> io::Result<Option<i32>> {
    use nix::sys::socket::{getsockopt, sockopt::LocalPeerPid};
    let pid = getsockopt(&fd, LocalPeerPid)?;
    Ok((pid > 0).then_some(pid))
}

/// NetBSD: `LOCAL_PEEREID` gives `struct unpcbid`.
#[cfg(target_os = "netbsd")]
fn peer_pid(fd: BorrowedFd<'_>) -> io::Result<Option<i32>> {
    // SAFETY: unpcbid is plain old data; all-zero bytes are a valid value.
    let mut id: libc::unpcbid = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::unpcbid>() as libc::socklen_t;
    // SAFETY: `id` and `len` are valid for writes and `len` holds the size of
    // `id`, as getsockopt(2) requires; `fd` is a live descriptor.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            // unix(4): NetBSD has no SOL_LOCAL; local options use level 0.
            0,
            libc::LOCAL_PEEREID,
            (&mut id as *mut libc::unpcbid).cast(),
            &mut len,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok((id.unp_pid > 0).then_some(id.unp_pid))
}

/// OpenBSD: `SO_PEERCRED` gives `struct sockpeercred`.
#[cfg(target_os = "openbsd")]
fn peer_pid(fd: BorrowedFd<'_>) -> io::Result<Option<i32>> {
    // SAFETY: sockpeercred is plain old data; all-zero bytes are a valid
    // value.
    let mut cred: libc::sockpeercred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockpeercred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the size
    // of `cred`, as getsockopt(2) requires; `fd` is a live descriptor.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::sockpeercred).cast(),
            &mut len,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid > 0).then_some(cred.pid))
}

/// DragonFly's `xucred` has no pid.
#[cfg(target_os = "dragonfly")]
fn peer_pid(_fd: BorrowedFd<'_>) -> io::Result<Option<i32>> {
    Ok(None)
}

pub(crate) fn process_ctx_switches(_pid: i32) -> io::Result<CtxSwitches> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "per-process context switch counts are only readable on Linux",
    ))
}

/// A pipe write wakes every blocked reader on FreeBSD, NetBSD, OpenBSD,
/// DragonFly and macOS: `pipe_write()` ends in `wakeup()` of the whole
/// channel (FreeBSD sys/kern/sys_pipe.c, `pipeselwakeup()` and
/// `wakeup(rpipe)`).
pub(crate) fn exclusive_pipe_read(_kernel: &Kernel) -> bool {
    false
}

pub(crate) fn mode_support(mode: Mode, _kernel: &Kernel) -> Result<(), String> {
    match mode {
        Mode::Epoll | Mode::EpollExclusive => {
            Err("epoll is a Linux interface; this OS has kqueue".to_owned())
        }
        Mode::KqueueClear | Mode::KqueueDispatch => Ok(()),
        Mode::Poll | Mode::Select | Mode::BlockingRead | Mode::Futex => Ok(()),
    }
}

/// No BSD can open a second description of an anonymous pipe: FreeBSD's
/// and macOS's `/dev/fd/N` duplicate the descriptor (fdescfs(5) reopens
/// only vnodes, and a pipe is not one).
pub(crate) fn reopen_pipe(_fd: BorrowedFd<'_>, _nonblocking: bool) -> io::Result<Option<OwnedFd>> {
    Ok(None)
}

/// One kqueue watching one pipe with `EVFILT_READ`. kqueue has no
/// exclusive wake-up: `EV_CLEAR`, `EV_DISPATCH` and `EV_ONESHOT` act on one
/// kqueue's knote, and a pipe write activates every process's knote
/// (kqueue(2); FreeBSD `pipeselwakeup()` calls `KNOTE_LOCKED()` on the
/// whole list).
#[derive(Debug)]
pub(crate) struct Poller {
    kq: Kqueue,
    ident: usize,
    /// `EV_DISPATCH` disables the knote at each delivery; re-enabled before
    /// every wait.
    dispatch: bool,
}

impl Poller {
    pub(crate) fn new(fd: BorrowedFd<'_>, mode: Mode, _trigger: Trigger) -> io::Result<Poller> {
        let (flags, dispatch) = match mode {
            Mode::KqueueClear => (EvFlags::EV_ADD | EvFlags::EV_CLEAR, false),
            Mode::KqueueDispatch => (EvFlags::EV_ADD | EvFlags::EV_DISPATCH, true),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{other} is not a kqueue mode"),
                ))
            }
        };
        let kq = Kqueue::new()?;
        // kqueue() has no close-on-exec flag of its own on every BSD; the
        // queue is never inherited by fork() children, but would survive
        // exec.
        fcntl(&kq, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
        let ident = usize::try_from(fd.as_raw_fd())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "negative fd"))?;
        let poller = Poller {
            kq,
            ident,
            dispatch,
        };
        poller.change(flags)?;
        Ok(poller)
    }

    /// Applies one change to the knote. With no room for events,
    /// kevent() returns at once, and reports a failed change as its own
    /// error rather than as an `EV_ERROR` event (kqueue(2)).
    fn change(&self, flags: EvFlags) -> io::Result<()> {
        let ev = KEvent::new(
            self.ident,
            EventFilter::EVFILT_READ,
            flags,
            FilterFlag::empty(),
            0,
            0,
        );
        self.kq.kevent(&[ev], &mut [], None)?;
        Ok(())
    }

    /// `kevent()` for one event, without a timeout. `EINTR` comes back to
    /// the caller as an `Interrupted` error.
    pub(crate) fn wait(&mut self) -> io::Result<()> {
        if self.dispatch {
            self.change(EvFlags::EV_ENABLE | EvFlags::EV_DISPATCH)?;
        }
        let mut events = [KEvent::new(
            0,
            EventFilter::EVFILT_READ,
            EvFlags::empty(),
            FilterFlag::empty(),
            0,
            0,
        )];
        while self.kq.kevent(&[], &mut events, None)? == 0 {}
        let ev = &events[0];
        if ev.flags().contains(EvFlags::EV_ERROR) && ev.data() != 0 {
            return Err(io::Error::from_raw_os_error(ev.data() as i32));
        }
        Ok(())
    }
}

/// FreeBSD: `_umtx_op(2)` with `UMTX_OP_WAIT_UINT` and `UMTX_OP_WAKE`, the
/// process-shared variants (the `_PRIVATE` ones key on the address space).
/// The kernel keys a shared wait on the VM object and offset, so processes
/// mapping the same file meet on the same word. Present since FreeBSD 8.
#[cfg(target_os = "freebsd")]
mod futex {
    use super::*;
    use std::ptr;

    pub(crate) fn futex_support(_kernel: &Kernel) -> Result<(), String> {
        Ok(())
    }

    pub(crate) fn futex_wait(word: &AtomicU32, expected: u32) -> io::Result<()> {
        // SAFETY: `word` is a live, aligned 32-bit word for the whole call.
        // UMTX_OP_WAIT_UINT reads it as a u_int; the null uaddr and uaddr2
        // mean no timeout, so no other memory is touched.
        let rc = unsafe {
            libc::_umtx_op(
                word.as_ptr().cast(),
                libc::UMTX_OP_WAIT_UINT,
                libc::c_ulong::from(expected),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        // A word that no longer holds `expected` returns 0, not an error.
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub(crate) fn futex_wake_one(word: &AtomicU32) -> io::Result<()> {
        // SAFETY: `word` is a live, aligned 32-bit word; UMTX_OP_WAKE uses
        // its address as a key and reads none of the null arguments.
        let rc = unsafe {
            libc::_umtx_op(
                word.as_ptr().cast(),
                libc::UMTX_OP_WAKE,
                1,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// NetBSD: the `__futex` system call, Linux-compatible, imported in 2020
/// and first released in NetBSD 10 (sys/kern/sys_futex.c). Without
/// `FUTEX_PRIVATE_FLAG` it keys on the mapped object, so processes mapping
/// the same file meet on the same word. An unknown system call raises
/// `SIGSYS` on NetBSD, so older kernels are ruled out by version first.
#[cfg(target_os = "netbsd")]
mod futex {
    use super::*;
    use std::ptr;

    /// sys/kern/syscalls.master: `166 STD { int|sys||__futex(int *uaddr,
    /// int op, int val, const struct timespec *timeout, int *uaddr2,
    /// int val2, int val3); }`. The `libc` crate does not define it.
    const SYS___FUTEX: libc::c_int = 166;

    pub(crate) fn futex_support(kernel: &Kernel) -> Result<(), String> {
        // 9.99.x are the development kernels that became NetBSD 10.
        if kernel.at_least(9, 99) {
            Ok(())
        } else {
            Err(format!(
                "the __futex system call needs NetBSD 10 or later; this is {}",
                kernel.release
            ))
        }
    }

    pub(crate) fn futex_wait(word: &AtomicU32, expected: u32) -> io::Result<()> {
        // SAFETY: `word` is a live, aligned 32-bit word for the whole call.
        // FUTEX_WAIT reads it; the timeout is null (no limit) and uaddr2,
        // val2 and val3 are unused by this op.
        let rc = unsafe {
            libc::syscall(
                SYS___FUTEX,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected as libc::c_int,
                ptr::null::<libc::timespec>(),
                ptr::null_mut::<libc::c_int>(),
                0 as libc::c_int,
                0 as libc::c_int,
            )
        };
        if rc == -1 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EAGAIN) {
                return Err(err);
            }
        }
        Ok(())
    }

    pub(crate) fn futex_wake_one(word: &AtomicU32) -> io::Result<()> {
        // SAFETY: `word` is a live, aligned 32-bit word; FUTEX_WAKE uses
        // its address as a key and dereferences none of the other
        // arguments.
        let rc = unsafe {
            libc::syscall(
                SYS___FUTEX,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                1 as libc::c_int,
                ptr::null::<libc::timespec>(),
                ptr::null_mut::<libc::c_int>(),
                0 as libc::c_int,
                0 as libc::c_int,
            )
        };
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// macOS, OpenBSD and DragonFly: no shared wake-one word is implemented.
/// macOS offers one only through `os_sync_wake_by_address_any()` with
/// `OS_SYNC_WAKE_BY_ADDRESS_SHARED` (macOS 14.4); OpenBSD's futex(2) and
/// DragonFly's umtx_sleep(2) are not wired up here.
#[cfg(not(any(target_os = "freebsd", target_os = "netbsd")))]
mod futex {
    use super::*;

    pub(crate) fn futex_support(_kernel: &Kernel) -> Result<(), String> {
        Err("no shared-memory wake-one primitive is implemented for this OS".to_owned())
    }

    fn unsupported() -> io::Error {
        io::Error::new(
            io::ErrorKind::Unsupported,
            "no shared-memory wake-one primitive is implemented for this OS",
        )
    }

    pub(crate) fn futex_wait(_word: &AtomicU32, _expected: u32) -> io::Result<()> {
        Err(unsupported())
    }

    pub(crate) fn futex_wake_one(_word: &AtomicU32) -> io::Result<()> {
        Err(unsupported())
    }
}

pub(crate) use futex::{futex_support, futex_wait, futex_wake_one};

/// Not here: the BSDs and macOS tell a process's exit through kqueue's
/// `EVFILT_PROC` with `NOTE_EXIT`, which is not a descriptor a mio loop can
/// register; a broker there learns of a client's end when its last
/// descriptor of the connection closes.
pub(crate) fn process_exit_fd(_pid: u32) -> io::Result<OwnedFd> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no process descriptors on this OS (kqueue EVFILT_PROC is not a descriptor)",
    ))
}
