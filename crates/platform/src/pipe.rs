//! Questions about a pipe that only an `ioctl` answers.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::fcntl::{fcntl, FcntlArg, OFlag};

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

/// `pipe2(O_CLOEXEC [| O_NONBLOCK])`, or on systems without `pipe2`
/// (macOS) `pipe(2)` followed by `fcntl(2)` on both ends.
///
/// # Portability
///
/// On macOS the two steps are not atomic: a `fork` in another thread in
/// between would inherit the descriptors. herdless only uses these pipes in
/// processes that do not fork from other threads at that moment.
pub fn pipe_cloexec(nonblocking: bool) -> io::Result<(OwnedFd, OwnedFd)> {
    #[cfg(not(any(target_os = "macos", target_os = "ios")))]
    {
        use nix::fcntl::OFlag;
        let mut flags = OFlag::O_CLOEXEC;
        if nonblocking {
            flags |= OFlag::O_NONBLOCK;
        }
        Ok(nix::unistd::pipe2(flags)?)
    }
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
        let (r, w) = nix::unistd::pipe()?;
        for fd in [&r, &w] {
            fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            if nonblocking {
                fcntl(fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
            }
        }
        Ok((r, w))
    }
}

/// The path through which this process can open its own descriptor `fd`
/// again: `/proc/self/fd/N` on Linux (which opens the pipe itself, a new
/// open file description), `/dev/fd/N` elsewhere (on FreeBSD, fdescfs must
/// be mounted there for numbers above 2; the BSDs and macOS give back the
/// same description).
pub fn fd_path(fd: RawFd) -> PathBuf {
    if cfg!(target_os = "linux") {
        PathBuf::from(format!("/proc/self/fd/{fd}"))
    } else {
        PathBuf::from(format!("/dev/fd/{fd}"))
    }
}

/// `(st_dev, st_ino)` of the pipe or FIFO open as this process's
/// descriptor `fd`, by `fstat(2)`: `None` when `fd` is not open or is not a
/// pipe or FIFO. No path is involved, so it answers on FreeBSD without
/// fdescfs too.
///
/// # Portability
///
/// On Linux both ends of one pipe have one inode. On FreeBSD and macOS each
/// end of a pipe has a number of its own, so two descriptors with the same
/// answer are one pipe's ends only on Linux; a FIFO opened twice has one
/// answer everywhere.
#[allow(clippy::unnecessary_cast)] // dev_t and ino_t differ in width between OSes
pub fn fifo_identity(fd: RawFd) -> Option<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one `struct stat` through the pointer, which
    // points at properly aligned storage of that size; an fd that is not
    // open makes it fail with EBADF and write nothing, and the result is
    // read only after success.
    let rc = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: fstat succeeded, so it filled the whole struct.
    let st = unsafe { st.assume_init() };
    ((st.st_mode & libc::S_IFMT) == libc::S_IFIFO).then_some((st.st_dev as u64, st.st_ino as u64))
}

/// The access mode this process's descriptor `fd` has (`O_RDONLY`,
/// `O_WRONLY` or `O_RDWR`), by `fcntl(F_GETFL)`: the mode of the open file
/// description itself, on every OS. `None` when `fd` is not open.
pub fn fd_access_mode(fd: RawFd) -> Option<OFlag> {
    // SAFETY: F_GETFL takes no argument and reads nothing through memory;
    // an fd that is not open makes it fail with EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    (flags >= 0).then(|| OFlag::from_bits_retain(flags) & OFlag::O_ACCMODE)
}

/// How this process's descriptor `fd` was opened: `O_RDONLY`, `O_WRONLY` or
/// `O_RDWR`, from `/proc/self/fdinfo` (Linux only; `None` elsewhere or when
/// unreadable).
pub fn access_mode(fd: RawFd) -> Option<OFlag> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .and_then(|v| i32::from_str_radix(v.trim(), 8).ok())?;
    Some(OFlag::from_bits_retain(flags) & OFlag::O_ACCMODE)
}

/// Shrinks the pipe or FIFO behind `fd` to one buffer (`F_SETPIPE_SZ` of
/// one page), so that any byte in it makes it full for `poll`: a
/// description opened for writing is then writable exactly when the pipe
/// is empty, and an edge-triggered `EPOLLOUT` on it fires when a reader
/// takes the last byte. The pipe still holds up to a page of bytes.
/// Returns whether the size was set.
///
/// # Portability
///
/// Linux only (`F_SETPIPE_SZ`); elsewhere it returns `Ok(false)` and the
/// pipe keeps its size.
///
/// A pipe of one buffer that never empties fills up with far fewer bytes
/// than a page: Linux appends to the buffer's page after the bytes read
/// from it, and frees the page only when the pipe is empty, so once a
/// page's worth has been written since it last was, a write finds it full
/// (blocking, or `EAGAIN`) with only the bytes still unread in it. Give
/// such a pipe its default size back ([`pipe_default_size`]) before
/// readers and writers that keep bytes in it take turns on it.
pub fn pipe_one_buffer(fd: BorrowedFd<'_>) -> io::Result<bool> {
    pipe_resize(fd, 4096)
}

/// Gives a pipe or FIFO shrunk by [`pipe_one_buffer`] the size Linux gives
/// a new pipe (16 pages). Returns whether the size was set.
///
/// # Portability
///
/// Linux only (`F_SETPIPE_SZ`); elsewhere it returns `Ok(false)`.
pub fn pipe_default_size(fd: BorrowedFd<'_>) -> io::Result<bool> {
    pipe_resize(fd, 16 * 4096)
}

fn pipe_resize(fd: BorrowedFd<'_>, bytes: i32) -> io::Result<bool> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        fcntl(fd, FcntlArg::F_SETPIPE_SZ(bytes))?;
        Ok(true)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = (fd, bytes);
        Ok(false)
    }
}

/// Whether the open file description behind `fd` is non-blocking.
pub fn is_nonblocking(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
    Ok(flags.contains(OFlag::O_NONBLOCK))
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

    #[test]
    fn cloexec_pipes_have_their_flags() {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
        for nonblocking in [false, true] {
            let (r, w) = pipe_cloexec(nonblocking).unwrap();
            for fd in [&r, &w] {
                let fd_flags = FdFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFD).unwrap());
                assert!(fd_flags.contains(FdFlag::FD_CLOEXEC));
                let fl = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL).unwrap());
                assert_eq!(fl.contains(OFlag::O_NONBLOCK), nonblocking);
            }
        }
    }
}
