//! Waking a process that waits in its own poll loop, from another process.
//!
//! A process asleep in `poll(2)` cannot also sleep on a futex, and another
//! process cannot write to a descriptor it does not have. What any process
//! of the same user can do is send it a signal: [`send_wake`] sends
//! [`WAKE_SIGNAL`] (`SIGURG`, whose default action is to ignore it, so a
//! signal that reaches a process which never asked for it does nothing).
//!
//! A process that wants such wake-ups makes a [`PollWake`] for the
//! descriptor it already polls. That installs, once per process, a handler
//! for the signal which writes to an eventfd of every live `PollWake`; each
//! `PollWake` is an epoll instance that watches both the original
//! descriptor and its eventfd. The caller polls [`PollWake::fd`] instead of
//! the original descriptor: it becomes readable when the original does,
//! and when the signal has come since the last [`PollWake::clear`]. A
//! signal that arrives before the caller enters `poll` leaves the eventfd
//! readable, so no wake-up is lost, whichever thread takes the signal (a
//! process that blocks `SIGURG` in every thread gets none, nor a process
//! the sender may not signal or, in another PID namespace, cannot name).
//!
//! The handler is installed with `SA_RESTART`, so the caller's reads,
//! writes and waits for children carry on; `poll`, `select` and sleeps
//! return `EINTR` as they do for any handled signal. It is not installed
//! over a handler the program has of its own: then [`PollWake::new`] fails
//! and the caller keeps to what it did before.
//!
//! The eventfds are never closed: the handler may read a registry entry in
//! one thread while another thread drops its `PollWake`, and a closed
//! descriptor's number could by then name another file. A dropped
//! `PollWake` leaves its eventfd in the registry for the next one; a
//! process has at most [`MAX_POLL_WAKES`] at once.

use std::io;

/// The signal [`send_wake`] sends.
pub const WAKE_SIGNAL: i32 = libc::SIGURG;

/// The most [`PollWake`]s a process has at once.
pub const MAX_POLL_WAKES: usize = 64;

/// The highest process id any kernel this runs on gives (Linux's
/// `PID_MAX_LIMIT` on 64-bit systems; FreeBSD's and NetBSD's are lower).
pub const PID_LIMIT: u32 = 4 * 1024 * 1024;

/// Whether `pid` may be sent a wake-up: a single process other than init,
/// never a process group or every process (0 and values that read as
/// negative to `kill(2)`).
pub fn valid_wake_pid(pid: u32) -> bool {
    pid > 1 && pid <= PID_LIMIT
}

/// Sends [`WAKE_SIGNAL`] to process `pid`. Whether it was sent: `false` for
/// a pid [`valid_wake_pid`] refuses, for a process that is gone, and for
/// one this process may not signal.
pub fn send_wake(pid: u32) -> bool {
    if !valid_wake_pid(pid) {
        return false;
    }
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) takes plain integers; `pid` is a single process
    // (checked above: > 1, so never a group or every process).
    unsafe { libc::kill(pid, WAKE_SIGNAL) == 0 }
}

#[cfg(target_os = "linux")]
pub use linux::PollWake;

#[cfg(not(target_os = "linux"))]
pub use other::PollWake;

#[cfg(target_os = "linux")]
mod linux {
    use std::io;
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::SeqCst};
    use std::sync::Mutex;

    use super::{MAX_POLL_WAKES, WAKE_SIGNAL};

    /// The eventfds, made on demand and never closed; -1: not made yet.
    static EVENTFDS: [AtomicI32; MAX_POLL_WAKES] = [const { AtomicI32::new(-1) }; MAX_POLL_WAKES];
    /// Which eventfds a live [`PollWake`] owns.
    static IN_USE: [AtomicBool; MAX_POLL_WAKES] =
        [const { AtomicBool::new(false) }; MAX_POLL_WAKES];
    /// Serialises making eventfds and installing the handler.
    static SETUP: Mutex<bool> = Mutex::new(false);

    extern "C" fn on_wake_signal(_sig: libc::c_int) {
        // SAFETY: __errno_location returns this thread's errno, valid for
        // the thread's life; the handler restores what it found.
        let errno = unsafe { *libc::__errno_location() };
        for (fd, used) in EVENTFDS.iter().zip(IN_USE.iter()) {
            let fd = fd.load(SeqCst);
            if fd >= 0 && used.load(SeqCst) {
                let one: u64 = 1;
                // SAFETY: write(2) is async-signal-safe; `fd` is an eventfd
                // this module made and never closes; `one` is 8 readable
                // bytes, as an eventfd write needs. A full counter fails
                // with EAGAIN (non-blocking), which still leaves it
                // readable.
                unsafe {
                    libc::write(fd, std::ptr::from_ref(&one).cast(), 8);
                }
            }
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
    }

    /// Installs the handler unless the program has one of its own.
    fn install() -> io::Result<()> {
        // SAFETY: an all-zero `sigaction` is a valid value of that plain C
        // struct; it is only an output buffer here.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a NULL new action only queries the disposition.
        if unsafe { libc::sigaction(WAKE_SIGNAL, std::ptr::null(), &mut old) } == -1 {
            return Err(io::Error::last_os_error());
        }
        let ours = on_wake_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        if old.sa_sigaction == ours {
            return Ok(());
        }
        if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "the program handles SIGURG itself",
            ));
        }
        // SAFETY: as above.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = ours;
        new.sa_flags = libc::SA_RESTART;
        // SAFETY: `new.sa_mask` is a valid sigset_t to empty.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
        // SAFETY: `new` is a complete action whose handler only makes
        // async-signal-safe calls; `old` receives the previous one.
        if unsafe { libc::sigaction(WAKE_SIGNAL, &new, &mut old) } == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn eventfd() -> io::Result<i32> {
        // SAFETY: eventfd(2) takes plain integers and returns a new
        // descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    }

    fn watch(epoll: &OwnedFd, fd: i32) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: `epoll` is an epoll descriptor, `fd` an open descriptor,
        // `ev` a valid event the kernel copies.
        if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A descriptor to poll that becomes readable when another does, or
    /// when [`WAKE_SIGNAL`] reaches this process (module docs).
    #[derive(Debug)]
    pub struct PollWake {
        epoll: OwnedFd,
        index: usize,
    }

    impl PollWake {
        /// Watches `fd` (for readability) and this process's wake
        /// signal. The returned value's [`fd`](Self::fd) is what to poll.
        ///
        /// # Errors
        ///
        /// `AlreadyExists` when the program handles `SIGURG` itself;
        /// `OutOfMemory` when [`MAX_POLL_WAKES`] are live; those of
        /// `eventfd(2)`, `epoll_create1(2)`, `epoll_ctl(2)`.
        pub fn new(fd: BorrowedFd<'_>) -> io::Result<PollWake> {
            let mut installed = super::lock(&SETUP);
            let index = IN_USE.iter().position(|u| !u.load(SeqCst)).ok_or_else(|| {
                io::Error::new(io::ErrorKind::OutOfMemory, "too many poll wake-ups")
            })?;
            if EVENTFDS[index].load(SeqCst) < 0 {
                EVENTFDS[index].store(eventfd()?, SeqCst);
            }
            let event = EVENTFDS[index].load(SeqCst);
            // SAFETY: epoll_create1(2) takes a flag and returns a new
            // descriptor or -1.
            let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a descriptor just made and owned by nobody
            // else.
            let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
            watch(&epoll, fd.as_raw_fd())?;
            watch(&epoll, event)?;
            if !*installed {
                install()?;
                *installed = true;
            }
            let wake = PollWake { epoll, index };
            wake.clear();
            IN_USE[index].store(true, SeqCst);
            Ok(wake)
        }

        /// The descriptor to poll for readability.
        pub fn fd(&self) -> BorrowedFd<'_> {
            self.epoll.as_fd()
        }

        /// Takes the wake-ups that have come: the descriptor stays
        /// readable until this is called (or the watched one is read).
        /// Call it before looking for what the wake-up was for.
        pub fn clear(&self) {
            let fd = EVENTFDS[self.index].load(SeqCst);
            let mut n: u64 = 0;
            // SAFETY: `fd` is a non-blocking eventfd this module keeps
            // open; `n` is 8 writable bytes. EAGAIN (nothing came) is the
            // usual answer and is not an error here.
            unsafe {
                libc::read(fd, std::ptr::from_mut(&mut n).cast(), 8);
            }
        }
    }

    impl Drop for PollWake {
        fn drop(&mut self) {
            IN_USE[self.index].store(false, SeqCst);
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod other {
    use std::io;
    use std::os::fd::BorrowedFd;

    /// Poll wake-ups are made on Linux only; elsewhere
    /// [`PollWake::new`] fails with `Unsupported`.
    #[derive(Debug)]
    pub struct PollWake {
        never: std::convert::Infallible,
    }

    impl PollWake {
        /// Fails with `Unsupported` on this OS.
        ///
        /// # Errors
        ///
        /// Always.
        pub fn new(_fd: BorrowedFd<'_>) -> io::Result<PollWake> {
            Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "poll wake-ups are made on Linux only",
            ))
        }

        /// The descriptor to poll.
        pub fn fd(&self) -> BorrowedFd<'_> {
            match self.never {}
        }

        /// Takes the wake-ups that have come.
        pub fn clear(&self) {
            match self.never {}
        }
    }
}

/// Locks `m`, taking over a lock a panicking thread left.
#[cfg(target_os = "linux")]
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`PollWake::new`] fails with where the OS has no poll wake-up.
pub fn poll_wake_support() -> io::Result<()> {
    if cfg!(target_os = "linux") {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "poll wake-ups are made on Linux only",
        ))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    fn readable(w: &PollWake, ms: u16) -> bool {
        let mut fds = [nix::poll::PollFd::new(w.fd(), nix::poll::PollFlags::POLLIN)];
        loop {
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)) {
                Ok(n) => return n > 0,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => panic!("poll: {e}"),
            }
        }
    }

    #[test]
    fn a_signal_or_the_watched_fd_makes_it_readable() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let w = PollWake::new(a.as_fd()).unwrap();
        assert!(!readable(&w, 0));
        // Sent before anyone polls: not lost.
        assert!(send_wake(std::process::id()));
        assert!(readable(&w, 1000));
        w.clear();
        assert!(!readable(&w, 0));
        std::io::Write::write_all(&mut b, b"x").unwrap();
        assert!(readable(&w, 1000));
        drop(w);
        // The slot is reused; its eventfd carried nothing over.
        let w2 = PollWake::new(a.as_fd()).unwrap();
        let mut byte = [0u8; 1];
        std::io::Read::read_exact(&mut &a, &mut byte).unwrap();
        assert!(!readable(&w2, 0));
        // A signal from another thread, while this one polls.
        let t = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            send_wake(std::process::id())
        });
        assert!(readable(&w2, 5000));
        assert!(t.join().unwrap());
    }

    #[test]
    fn refuses_what_is_not_one_process() {
        for pid in [0, 1, u32::MAX, u32::MAX - 1, PID_LIMIT + 1, 0x8000_0000] {
            assert!(!send_wake(pid), "{pid}");
        }
    }
}
