//! Credentials of the process at the other end of a Unix socket.

use std::io;
use std::os::fd::BorrowedFd;

use crate::sys;

/// Who is at the other end of a connected Unix domain socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCred {
    /// The peer's effective user id.
    pub uid: u32,
    /// The peer's process id, where the OS reports it and the peer is
    /// visible from here (on Linux, a peer in another pid namespace reads as
    /// pid 0, which becomes `None`).
    pub pid: Option<i32>,
}

/// `getsockopt(SO_PEERCRED)` / `getpeereid()` — the credentials of the peer
/// of a connected Unix domain socket.
///
/// The credentials are those the peer had when it called `connect()` or
/// `socketpair()`, not its current ones.
///
/// # Errors
///
/// The OS error of the call: `ENOTSOCK` when `fd` is not a socket,
/// `ENOTCONN` when it is not connected, `EINVAL`/`EOPNOTSUPP` when it is not
/// a Unix domain socket.
///
/// # Portability
///
/// - Linux: `getsockopt(SOL_SOCKET, SO_PEERCRED)`, uid and pid.
/// - FreeBSD: `getpeereid()` for the uid; the pid from
///   `getsockopt(SOL_LOCAL, LOCAL_PEERCRED)` (`xucred.cr_pid`, filled in
///   since FreeBSD 13; `None` before).
/// - macOS/iOS: `getpeereid()`; the pid from
///   `getsockopt(SOL_LOCAL, LOCAL_PEERPID)`.
/// - NetBSD: `getpeereid()`; the pid from
///   `getsockopt(SOL_LOCAL, LOCAL_PEEREID)` (`unpcbid.unp_pid`).
/// - OpenBSD: `getpeereid()`; the pid from
///   `getsockopt(SOL_SOCKET, SO_PEERCRED)` (`sockpeercred.pid`).
/// - DragonFly: `getpeereid()`; the pid is always `None`.
pub fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<PeerCred> {
    sys::peer_cred(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn socketpair_peer_is_us() {
        let (a, b) = UnixStream::pair().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        for s in [&a, &b] {
            let cred = peer_cred(s.as_fd()).unwrap();
            assert_eq!(cred.uid, me);
            #[cfg(any(
                target_os = "linux",
                target_os = "macos",
                target_os = "netbsd",
                target_os = "openbsd"
            ))]
            assert_eq!(cred.pid, Some(std::process::id() as i32));
            if let Some(pid) = cred.pid {
                assert_eq!(pid, std::process::id() as i32);
            }
        }
    }

    #[test]
    fn not_a_socket_is_an_error() {
        let (r, _w) = nix::unistd::pipe().unwrap();
        assert!(peer_cred(r.as_fd()).is_err());
    }
}
