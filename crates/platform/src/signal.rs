//! Signal dispositions, and who sent a signal.

use std::io;

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
}
