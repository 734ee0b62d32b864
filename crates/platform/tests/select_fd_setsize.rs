//! select() refuses descriptors at or above FD_SETSIZE instead of writing
//! past its fd_set. Its own test binary: it fills the descriptor table.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use herdless_platform::wait::{Mode, PipeWaiter};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::select::FD_SETSIZE;

#[test]
fn select_refuses_high_descriptors() {
    let (r, _w) = nix::unistd::pipe().unwrap();
    let want = (FD_SETSIZE + 64) as nix::libc::rlim_t;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if hard < want {
        eprintln!("skipped: RLIMIT_NOFILE hard limit {hard} is below {want}");
        return;
    }
    if soft < want {
        setrlimit(Resource::RLIMIT_NOFILE, want, hard).unwrap();
    }
    // Fill every descriptor below FD_SETSIZE, so the waiter's duplicate
    // lands above it.
    let mut filler: Vec<OwnedFd> = Vec::new();
    loop {
        let fd = r.try_clone().unwrap();
        let n = std::os::fd::AsRawFd::as_raw_fd(&fd) as usize;
        filler.push(fd);
        if n >= FD_SETSIZE - 1 {
            break;
        }
    }
    let err = PipeWaiter::new(r.as_fd(), Mode::Select).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("FD_SETSIZE"), "{err}");
    // poll has no such limit.
    PipeWaiter::new(r.as_fd(), Mode::Poll).unwrap();
}
