//! Modes the OS lacks are reported, never emulated.

use std::io;
use std::os::fd::AsFd;

use herdless_platform::wait::{Mode, PipeWaiter};

#[cfg(target_os = "linux")]
const MISSING: &[Mode] = &[Mode::KqueueClear, Mode::KqueueDispatch];
#[cfg(not(target_os = "linux"))]
const MISSING: &[Mode] = &[Mode::Epoll, Mode::EpollExclusive];

#[test]
fn missing_modes_are_unavailable() {
    let (r, _w) = nix::unistd::pipe().unwrap();
    for &mode in MISSING {
        let why = mode.available().unwrap_err();
        assert_eq!(why.mode(), mode);
        assert!(!why.reason().is_empty());
        let err = PipeWaiter::new(r.as_fd(), mode).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported, "{mode}");
        assert!(err.to_string().contains(mode.name()), "{err}");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn linux_capabilities_match_the_kernel() {
    let caps = herdless_platform::capabilities();
    assert_eq!(caps.kernel.sysname, "Linux");
    assert!(!caps.kqueue);
    assert!(caps.futex);
    assert_eq!(caps.epoll_exclusive, caps.kernel.at_least(4, 5));
    assert_eq!(caps.exclusive_pipe_read, caps.kernel.at_least(5, 6));
    assert_eq!(
        caps.epoll_exclusive,
        Mode::EpollExclusive.available().is_ok()
    );
    assert_eq!(Mode::Epoll.available(), Ok(()));
    assert_eq!(Mode::Futex.available(), Ok(()));
}

#[cfg(not(target_os = "linux"))]
#[test]
fn bsd_capabilities() {
    let caps = herdless_platform::capabilities();
    assert!(caps.kqueue);
    assert!(!caps.epoll_exclusive);
    assert!(!caps.exclusive_pipe_read);
    assert_eq!(caps.futex, Mode::Futex.available().is_ok());
}
