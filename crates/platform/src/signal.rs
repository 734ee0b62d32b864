//! Signal dispositions.

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
}
