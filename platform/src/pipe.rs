//! Questions about a pipe that only an `ioctl` answers.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `ioctl(fd, FIONREAD)`: how many bytes wait unread in the pipe or FIFO
/// behind `fd` (or in a socket's receive buffer).
///
/// The answer is a snapshot: other readers and writers of the same pipe may
/// change it at any moment, so use it for accounting, not to decide that a
/// blocking read will not block.
///
/// # Portability
///
/// `FIONREAD` on pipes is supported by Linux, the BSDs and macOS.
pub fn bytes_readable(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at
    // a live, properly aligned c_int; the fd is borrowed, so it stays open
    // for the duration of the call.
    let rc = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::FIONREAD as _,
            &mut n as *mut libc::c_int,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn counts_unread_bytes() {
        let (r, w) = nix::unistd::pipe().unwrap();
        assert_eq!(bytes_readable(r.as_fd()).unwrap(), 0);
        let mut w = std::fs::File::from(w);
        w.write_all(b"+++").unwrap();
        assert_eq!(bytes_readable(r.as_fd()).unwrap(), 3);
    }
}
