//! What the running kernel offers.

use crate::kernel::{kernel, Kernel};
use crate::sys;
use crate::wait::Mode;

/// The running kernel and the wake-up primitives it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The kernel, from `uname()`.
    pub kernel: Kernel,
    /// `EPOLLEXCLUSIVE`: Linux 4.5 and later.
    pub epoll_exclusive: bool,
    /// Blocking pipe reads wake one reader per byte: Linux 5.6 and later.
    pub exclusive_pipe_read: bool,
    /// A wake-one word shared between processes ([`SharedWord`](crate::SharedWord)).
    pub futex: bool,
    /// kqueue, with `EV_CLEAR` and `EV_DISPATCH`.
    pub kqueue: bool,
}

/// Detects the kernel's capabilities.
///
/// Calls `uname()` once and decides from the OS and release; it probes
/// nothing, because a probe cannot tell some features apart (Linux before
/// 4.5 accepts and ignores `EPOLLEXCLUSIVE`).
///
/// # Portability
///
/// On the BSDs, `epoll_exclusive` and `exclusive_pipe_read` are always
/// false (a pipe write wakes every reader and every knote); on Linux,
/// `kqueue` is false.
pub fn capabilities() -> Capabilities {
    let kernel = kernel();
    Capabilities {
        epoll_exclusive: Mode::EpollExclusive.available_on(&kernel).is_ok(),
        exclusive_pipe_read: sys::exclusive_pipe_read(&kernel),
        futex: Mode::Futex.available_on(&kernel).is_ok(),
        kqueue: Mode::KqueueClear.available_on(&kernel).is_ok(),
        kernel,
    }
}
