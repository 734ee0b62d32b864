//! BSD backend: FreeBSD, NetBSD, OpenBSD, DragonFly and Apple systems, which
//! share kqueue.
//!
//! This file cannot be compiled on the Linux machines the project is
//! developed on; every ABI detail comes from the `libc` and `nix` crates'
//! definitions for the target, never from hand-written structs.

use std::io;
use std::os::fd::BorrowedFd;

use crate::cred::PeerCred;
use crate::usage::CtxSwitches;

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
    use std::os::fd::AsRawFd;
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
    use std::os::fd::AsRawFd;
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
    use std::os::fd::AsRawFd;
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
