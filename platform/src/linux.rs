//! Linux backend.

use std::io;
use std::os::fd::BorrowedFd;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use crate::cred::PeerCred;
use crate::usage::{parse_proc_status, CtxSwitches};

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
