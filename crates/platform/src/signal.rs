//! Signal dispositions, and who sent a signal.

use std::io;

use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow, Signal};

/// `sigaction(sig, NULL, &old)`: whether `sig` is ignored (`SIG_IGN`) in
/// this process, as it is for SIGHUP under `nohup` or for SIGINT in a
/// shell's background jobs. A program that wraps a command must leave such
/// signals ignored, so the command inherits the same disposition.
///
/// # Errors
///
/// `EINVAL` for an invalid signal number.
pub fn signal_ignored(sig: i32) -> io::Result<bool> {
    // SAFETY: an all-zero `sigaction` is a valid value of that plain C
    // struct; it is only an output buffer here.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a NULL new action only queries the disposition; `old` is a
    // valid, writable `sigaction` for the kernel to fill.
    let rc = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(old.sa_sigaction == libc::SIG_IGN)
}

/// Whether a signal whose `siginfo_t` has this `si_code` came from the
/// kernel itself (`SI_KERNEL`), as a terminal's Ctrl-C does on Linux and
/// FreeBSD, rather than from a process's `kill`. Systems without such a
/// code (macOS, NetBSD) always get `false`.
pub fn sent_by_kernel(si_code: i32) -> bool {
    SI_KERNEL == Some(si_code)
}

/// The signals a fault raises in the thread that caused it. They stay
/// unblocked in a thread of [`spawn_unsignalled`]: a fault with its signal
/// blocked kills the process without running the handler (Rust's stack
/// overflow report, a host's crash handler).
const SYNCHRONOUS: [Signal; 6] = [
    Signal::SIGSEGV,
    Signal::SIGBUS,
    Signal::SIGFPE,
    Signal::SIGILL,
    Signal::SIGTRAP,
    Signal::SIGSYS,
];

/// Spawns a thread that never runs a handler for a signal sent to the
/// process: it starts with every signal blocked but the synchronous ones
/// (a fault's own).
///
/// A signal sent to a process (`kill`, a child's `SIGCHLD`, the table's
/// `SIGURG` wake-up) is delivered to any one of its threads that does not
/// block it. A thread that the library starts inside a host program (the
/// broker of a make, the death guard, a slot's lock helper) has no use for
/// them: taking one only wakes it for nothing, a context switch the host
/// would not have paid, and runs the host's handler on a thread the host
/// does not know of (a make's `SIGINT` handler that stops the broker, run
/// on the broker's own thread). So such threads block them, and the host's
/// threads take every one.
///
/// The mask is set in the calling thread around the spawn, which the new
/// thread inherits, so there is no moment at which the new thread takes a
/// signal; the caller's own mask is put back before this returns (a signal
/// that came meanwhile stays pending until then, and is not lost).
///
/// # Errors
///
/// The spawn's error; the caller's mask is put back first.
pub fn spawn_unsignalled<F, T>(
    builder: std::thread::Builder,
    f: F,
) -> io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let mut block = SigSet::all();
    for sig in SYNCHRONOUS {
        block.remove(sig);
    }
    let mut old = SigSet::empty();
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&block), Some(&mut old))?;
    let spawned = builder.spawn(f);
    // Putting back a mask read a moment ago cannot fail (EINVAL is for a
    // bad `how`).
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    spawned
}

#[cfg(target_os = "linux")]
const SI_KERNEL: Option<i32> = Some(libc::SI_KERNEL);
/// `<sys/signal.h>`; the libc crate does not define it for FreeBSD.
#[cfg(target_os = "freebsd")]
const SI_KERNEL: Option<i32> = Some(0x10006);
#[cfg(not(any(target_os = "linux", target_os = "freebsd")))]
const SI_KERNEL: Option<i32> = None;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_disposition() {
        // Rust ignores SIGPIPE in every program it starts; SIGTERM is left
        // at its default.
        assert!(signal_ignored(libc::SIGPIPE).unwrap());
        assert!(!signal_ignored(libc::SIGTERM).unwrap());
        assert!(signal_ignored(-1).is_err());
    }

    #[test]
    fn only_si_kernel_is_the_kernel() {
        // SI_USER, what kill(2) sets: 0 on Linux and NetBSD, 0x10001 on
        // FreeBSD and macOS.
        assert!(!sent_by_kernel(0));
        assert!(!sent_by_kernel(0x10001));
        #[cfg(target_os = "linux")]
        assert!(sent_by_kernel(0x80));
        #[cfg(target_os = "freebsd")]
        assert!(sent_by_kernel(0x10006));
    }

    /// The signal mask of thread `tid` of this process, from
    /// `/proc/self/task/TID/status` (`SigBlk`).
    #[cfg(target_os = "linux")]
    fn blocked_of(tid: i32) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = s.lines().find(|l| l.starts_with("SigBlk:")).unwrap();
        u64::from_str_radix(line["SigBlk:".len()..].trim(), 16).unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_unsignalled_thread_blocks_all_but_faults_and_the_caller_keeps_its_mask() {
        let bit = |s: i32| 1u64 << (s - 1);
        // SAFETY: gettid has no arguments and cannot fail.
        let me = unsafe { libc::gettid() };
        let before = blocked_of(me);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = spawn_unsignalled(std::thread::Builder::new(), move || {
            // SAFETY: as above.
            tx.send(unsafe { libc::gettid() }).unwrap();
            std::thread::park();
        })
        .unwrap();
        let tid = rx.recv().unwrap();
        let mask = blocked_of(tid);
        t.thread().unpark();
        t.join().unwrap();
        for s in [
            libc::SIGURG,
            libc::SIGCHLD,
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
        ] {
            assert_ne!(mask & bit(s), 0, "signal {s} not blocked: {mask:#x}");
        }
        for s in [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL] {
            assert_eq!(mask & bit(s), 0, "fault signal {s} blocked: {mask:#x}");
        }
        assert_eq!(blocked_of(me), before, "the caller's mask changed");
    }
}
