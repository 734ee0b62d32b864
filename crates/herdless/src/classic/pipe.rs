//! Opening a classic jobserver's pipe or fifo, and moving single bytes
//! through it.
//!
//! Every process in a classic tree shares the pipe; what it must not share
//! is the pipe's *open file description*, because `O_NONBLOCK` lives there
//! and GNU make before 4.3 treats `EAGAIN` on its own reads as fatal. So
//! this client reads through a description of its own wherever the OS can
//! make one:
//!
//! - `fifo:PATH`: `open(PATH, O_RDONLY | O_NONBLOCK)`, on every OS.
//! - `R,W` on Linux: `open("/proc/self/fd/R", O_RDONLY | O_NONBLOCK)`.
//!   Opening the proc entry of a pipe runs the fifo open path on that pipe
//!   and yields a new description (proc(5)). The write side is reopened the
//!   same way, `O_WRONLY`.
//! - `R,W` elsewhere: `open("/dev/fd/R")`, which on the BSDs and macOS
//!   duplicates the descriptor and so shares its description (fdescfs(5);
//!   FreeBSD needs fdescfs mounted on `/dev/fd` for numbers above 2). When
//!   that shared description is already non-blocking — GNU make 4.3 and
//!   later and bmake make it so — claims read it directly; when it is
//!   blocking, only a blocking wait can take a token (see [`Claim`]).
//!
//! The descriptor numbers are reached through those paths rather than
//! `fcntl(R, …)` because this crate has no `unsafe`, and borrowing a raw
//! descriptor number is unsafe in Rust's I/O-safety model.

use std::fs::{Metadata, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use herdless_platform::{access_mode, fd_path, is_nonblocking};

use super::auth::{Auth, Flavor, Jobserver};
use crate::error::{Error, ErrorKind, Result};

/// How a token byte can be claimed from the read description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A non-blocking description of this process's own.
    Private,
    /// The description shared with the other processes, already
    /// non-blocking (GNU make ≥ 4.3 and bmake make theirs so).
    SharedNonblocking,
    /// The shared description, blocking, on an OS that cannot open another:
    /// a read may block, so only a wait without a deadline can take a
    /// token, by a blocking `read()` (every waiter wakes, as on any BSD).
    SharedBlocking,
}

/// The opened pipe or fifo.
#[derive(Debug)]
pub(crate) struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    claim: Claim,
    /// `(st_dev, st_ino)` of the pipe or fifo: which jobserver this is.
    id: (u64, u64),
    /// "fd 3" / "fifo /tmp/x", for messages.
    what: String,
}

/// What `read()` of one byte found.
pub(crate) enum Read {
    Byte(u8),
    Empty,
}

impl Pipe {
    /// Opens the jobserver `js` names and checks it is usable.
    ///
    /// # Errors
    ///
    /// `NotFound` for a disabled jobserver; `BadJobserver`, naming the fd or
    /// path and why, when it is not open, not a pipe or fifo, open the wrong
    /// way, or when the two fds are not the two ends of one pipe.
    pub(crate) fn open(js: &Jobserver) -> Result<Pipe> {
        match js.auth() {
            Auth::Disabled => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "{} disables the jobserver ({}): this process runs without one",
                    js.source(),
                    js.option()
                ),
            )),
            Auth::Fifo(path) => open_fifo(js, path),
            Auth::Fds { read, write } => open_fds(js, *read, *write),
        }
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }

    pub(crate) fn claim_mode(&self) -> Claim {
        self.claim
    }

    pub(crate) fn id(&self) -> (u64, u64) {
        self.id
    }

    pub(crate) fn what(&self) -> &str {
        &self.what
    }

    /// Reads one byte without blocking (in `SharedBlocking` mode: with a
    /// blocking read, so only for a wait with no deadline). `EINTR` is
    /// retried: an interruptible wait is the waiter's job, not the claim's.
    pub(crate) fn read_byte(&self) -> io::Result<Read> {
        let mut byte = [0u8; 1];
        loop {
            match nix::unistd::read(&self.read, &mut byte) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "the jobserver {} has no writer left (did the make that owns it exit?)",
                            self.what
                        ),
                    ))
                }
                Ok(_) => return Ok(Read::Byte(byte[0])),
                Err(Errno::EAGAIN) => return Ok(Read::Empty),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Empties the pipe of whatever it holds, without blocking (what bmake
    /// does before it puts an abort token in). Returns how many bytes it
    /// took. A `SharedBlocking` pipe is left as it is.
    pub(crate) fn drain(&self) -> io::Result<usize> {
        if self.claim == Claim::SharedBlocking {
            return Ok(0);
        }
        let mut buf = [0u8; 256];
        let mut taken = 0;
        loop {
            match nix::unistd::read(&self.read, &mut buf) {
                Ok(0) => return Ok(taken),
                Ok(n) => taken += n,
                Err(Errno::EAGAIN) => return Ok(taken),
                Err(Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Writes one byte, waiting for room if the pipe is full.
    pub(crate) fn write_byte(&self, byte: u8) -> io::Result<()> {
        loop {
            match nix::unistd::write(&self.write, &[byte]) {
                Ok(1) => return Ok(()),
                Ok(_) => {}
                Err(Errno::EAGAIN) => {
                    // Only a pipe holding 64 KiB of tokens is full; wait for
                    // a reader to take some.
                    let mut fds = [PollFd::new(self.write.as_fd(), PollFlags::POLLOUT)];
                    match poll(&mut fds, PollTimeout::NONE) {
                        Ok(_) | Err(Errno::EINTR) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

fn bad(msg: String) -> Error {
    Error::new(ErrorKind::BadJobserver, msg)
}

fn hint(js: &Jobserver) -> &'static str {
    match js.flavor() {
        Flavor::Gnu => "was the recipe not marked with + ?",
        Flavor::Bmake => "is the target not marked .MAKE?",
    }
}

fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_fifo() {
        "a pipe"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a pipe"
    }
}

/// Checks that `fd` is open and is a pipe or fifo; returns its metadata.
fn check_fd(js: &Jobserver, fd: RawFd) -> Result<Metadata> {
    let src = js.source();
    if cfg!(target_os = "linux") && !Path::new("/proc/self/fd").is_dir() {
        return Err(bad(format!(
            "cannot check jobserver fd {fd} named in {src}: /proc is not mounted"
        )));
    }
    let meta = match std::fs::metadata(fd_path(fd)) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let extra = if cfg!(target_os = "freebsd") && fd > 2 {
                " or fdescfs is not mounted on /dev/fd"
            } else {
                ""
            };
            return Err(bad(format!(
                "{src} names jobserver fd {fd}, which is not open ({}){extra}",
                hint(js)
            )));
        }
        Err(e) => {
            return Err(Error::io(
                ErrorKind::BadJobserver,
                format!("cannot check jobserver fd {fd} named in {src}"),
                e,
            ))
        }
    };
    if !meta.file_type().is_fifo() {
        return Err(bad(format!(
            "{src} names jobserver fd {fd}, which is {}, not a pipe or fifo \
             (the number was reused for another file: {})",
            kind_of(&meta),
            hint(js)
        )));
    }
    Ok(meta)
}

fn open_fds(js: &Jobserver, r: RawFd, w: RawFd) -> Result<Pipe> {
    let src = js.source();
    let rmeta = check_fd(js, r)?;
    let wmeta = check_fd(js, w)?;
    if access_mode(r) == Some(OFlag::O_WRONLY) {
        return Err(bad(format!(
            "{src} names jobserver fd {r} as the read end, but it is open for writing only"
        )));
    }
    if access_mode(w) == Some(OFlag::O_RDONLY) {
        return Err(bad(format!(
            "{src} names jobserver fd {w} as the write end, but it is open for reading only"
        )));
    }
    // Both ends of one pipe are one inode (and a fifo opened twice is too),
    // but for a herdless broker's pipe: two FIFOs, the one read named in
    // `HERDLESS_CLASSIC` (a client that its broker turned away, short of
    // descriptors, comes here).
    let broker_pair = || {
        std::env::var_os(crate::client::CLASSIC_ENV).is_some_and(|own| {
            own.as_encoded_bytes()
                == crate::client::classic_env_value((rmeta.dev(), rmeta.ino())).as_bytes()
        })
    };
    if (rmeta.dev(), rmeta.ino()) != (wmeta.dev(), wmeta.ino()) && !broker_pair() {
        return Err(bad(format!(
            "{src} names jobserver fds {r},{w}, which are not the two ends of one pipe"
        )));
    }
    let cannot_open = |fd: RawFd, e: io::Error| {
        Error::io(
            ErrorKind::BadJobserver,
            format!("cannot open jobserver fd {fd} named in {src}"),
            e,
        )
    };
    let read: OwnedFd = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fd_path(r))
        .map_err(|e| cannot_open(r, e))?
        .into();
    // With a reader open (ours), a non-blocking open for writing cannot
    // fail with ENXIO.
    let write: OwnedFd = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fd_path(w))
        .map_err(|e| cannot_open(w, e))?
        .into();
    let claim = if cfg!(target_os = "linux") {
        Claim::Private
    } else if is_nonblocking(read.as_fd()).map_err(|e| cannot_open(r, e))? {
        Claim::SharedNonblocking
    } else {
        Claim::SharedBlocking
    };
    same_file(&read, &rmeta).map_err(|e| cannot_open(r, e))?;
    Ok(Pipe {
        read,
        write,
        claim,
        id: (rmeta.dev(), rmeta.ino()),
        what: format!("pipe (fds {r},{w})"),
    })
}

fn open_fifo(js: &Jobserver, path: &Path) -> Result<Pipe> {
    let src = js.source();
    let shown = path.display();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(bad(format!(
                "{src} names jobserver fifo {shown}, which does not exist \
                 (did the make that created it exit?)"
            )))
        }
        Err(e) => {
            return Err(Error::io(
                ErrorKind::BadJobserver,
                format!("cannot reach jobserver fifo {shown} named in {src}"),
                e,
            ))
        }
    };
    if !meta.file_type().is_fifo() {
        return Err(bad(format!(
            "{src} names jobserver fifo {shown}, which is {}, not a fifo",
            kind_of(&meta)
        )));
    }
    let cannot_open = |e: io::Error| {
        Error::io(
            ErrorKind::BadJobserver,
            format!("cannot open jobserver fifo {shown} named in {src}"),
            e,
        )
    };
    // Non-blocking opens: a blocking open of a fifo waits for the other
    // side (fifo(7)). The read side first, so that the write side finds a
    // reader.
    let read: OwnedFd = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(cannot_open)?
        .into();
    let write: OwnedFd = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(cannot_open)?
        .into();
    same_file(&read, &meta).map_err(cannot_open)?;
    Ok(Pipe {
        read,
        write,
        claim: Claim::Private,
        id: (meta.dev(), meta.ino()),
        what: format!("fifo {shown}"),
    })
}

/// Guards against the path being replaced between the check and the open.
#[allow(clippy::unnecessary_cast)] // dev_t is i32 on macOS, u64 on Linux
fn same_file(fd: &OwnedFd, meta: &Metadata) -> io::Result<()> {
    let opened = nix::sys::stat::fstat(fd)?;
    if (opened.st_dev as u64, opened.st_ino as u64) != (meta.dev(), meta.ino()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "it changed while it was being opened",
        ));
    }
    Ok(())
}
