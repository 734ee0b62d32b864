//! The token table a broker shares with its native clients on the same
//! host: an anonymous memory file (`memfd`), sealed against resizing,
//! mapped `MAP_SHARED` by the broker and by every client it passes the
//! descriptor to (`SCM_RIGHTS`, [`send_with_fd`], [`recv_with_fd`]).
//!
//! This module only maps memory and hands out references to the atomic
//! words in it; what the words mean is the library's business
//! (`herdless::fast`). Every access is atomic, so another process writing
//! anything at any time can change values but never make an access
//! undefined, and the seals keep the mapping backed for as long as it lives
//! (a process holding the descriptor cannot shrink the file under it,
//! which would make the next access raise `SIGBUS`).
//!
//! # Layout
//!
//! A header of [`HEADER_WORDS`] 32-bit words, then `words` 32-bit words.
//! The header's words 8 and 9 form one 64-bit, 8-aligned word
//! ([`Segment::counter64`]).

use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::stat::fstat;

/// 32-bit words before the table.
pub const HEADER_WORDS: u32 = 16;

/// The most table words a segment may have.
pub const MAX_WORDS: u32 = 1 << 16;

/// A mapped segment: a header and a table of 32-bit words.
#[derive(Debug)]
pub struct Segment {
    base: NonNull<AtomicU32>,
    len: usize,
    words: u32,
    fd: OwnedFd,
}

// SAFETY: the mapping is process-wide and lives until drop; it is only ever
// accessed through `&AtomicU32` and `&AtomicU64`, which are `Sync`.
unsafe impl Send for Segment {}
// SAFETY: as above; every operation through `&self` is atomic.
unsafe impl Sync for Segment {}

fn byte_len(words: u32) -> usize {
    (HEADER_WORDS as usize + words as usize) * std::mem::size_of::<AtomicU32>()
}

impl Segment {
    /// Makes a new sealed memory file of `words` table words (all 0) and
    /// maps it.
    ///
    /// # Errors
    ///
    /// `InvalidInput` for 0 or more than [`MAX_WORDS`] words; `Unsupported`
    /// where the OS has no sealable memory file (anything but Linux ≥ 3.17);
    /// the OS error of `memfd_create`, `ftruncate`, `fcntl` or `mmap`.
    pub fn create(words: u32) -> io::Result<Segment> {
        if words == 0 || words > MAX_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a segment has 1 to {MAX_WORDS} words, not {words}"),
            ));
        }
        let fd = memfd()?;
        let len = byte_len(words);
        nix::unistd::ftruncate(&fd, len as libc::off_t)?;
        seal(&fd)?;
        Segment::map(fd, words)
    }

    /// Maps a segment received from its maker, which says it has `words`
    /// table words.
    ///
    /// # Errors
    ///
    /// `InvalidData` when the file is not a sealed memory file of exactly
    /// that size, or `words` is out of range; the OS error of `fstat` or
    /// `mmap`.
    pub fn open(fd: OwnedFd, words: u32) -> io::Result<Segment> {
        if words == 0 || words > MAX_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a segment has 1 to {MAX_WORDS} words, not {words}"),
            ));
        }
        let st = fstat(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || usize::try_from(st.st_size).ok() != Some(byte_len(words))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the segment is not a file of {} bytes ({} bytes)",
                    byte_len(words),
                    st.st_size
                ),
            ));
        }
        if !sealed(&fd)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the segment is not sealed against resizing",
            ));
        }
        Segment::map(fd, words)
    }

    fn map(fd: OwnedFd, words: u32) -> io::Result<Segment> {
        let len = byte_len(words);
        let nz = NonZeroUsize::new(len).expect("a segment is not empty");
        // SAFETY: a new mapping at an address of the kernel's choosing
        // overlaps no Rust object. The file is exactly `len` bytes long and
        // sealed against shrinking, so every mapped byte stays backed; the
        // page alignment satisfies AtomicU32's and AtomicU64's alignment.
        let ptr = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )?
        };
        Ok(Segment {
            base: ptr.cast(),
            len,
            words,
            fd,
        })
    }

    /// Table words.
    pub fn words(&self) -> u32 {
        self.words
    }

    fn at(&self, index: usize) -> &AtomicU32 {
        assert!(index < HEADER_WORDS as usize + self.words as usize);
        // SAFETY: `index` is inside the mapping (checked above), which is
        // live, backed (sealed) and aligned until `self` drops, and is only
        // ever accessed atomically, by this and other processes.
        unsafe { &*self.base.as_ptr().add(index) }
    }

    /// Header word `i` (`i < HEADER_WORDS`).
    ///
    /// # Panics
    ///
    /// When `i` is out of range.
    pub fn header(&self, i: u32) -> &AtomicU32 {
        assert!(i < HEADER_WORDS, "header word {i} out of range");
        self.at(i as usize)
    }

    /// Table word `i` (`i < words()`).
    ///
    /// # Panics
    ///
    /// When `i` is out of range.
    pub fn word(&self, i: u32) -> &AtomicU32 {
        assert!(i < self.words, "table word {i} out of range");
        self.at(HEADER_WORDS as usize + i as usize)
    }

    /// The 64-bit counter made of header words 8 and 9.
    pub fn counter64(&self) -> &AtomicU64 {
        // SAFETY: header words 8 and 9 lie inside the mapping at byte
        // offset 32 from its page-aligned start, so the pointer is 8-aligned
        // and 8 bytes are backed; they are only ever accessed as this
        // atomic (`header` refuses nothing there, so the library keeps to
        // this accessor for them).
        unsafe { &*self.base.as_ptr().add(8).cast::<AtomicU64>() }
    }

    /// Wakes at most one process sleeping in [`wait_word`](Self::wait_word)
    /// on table word `i`.
    ///
    /// # Errors
    ///
    /// The OS error of the wake call.
    pub fn wake_one(&self, i: u32) -> io::Result<()> {
        crate::sys::futex_wake_one(self.word(i))
    }

    /// Sleeps while table word `i` holds `expected` (returns at once when
    /// it does not; may return early, as a futex does).
    ///
    /// # Errors
    ///
    /// `Interrupted` on a signal; the OS error of the wait call.
    pub fn wait_word(&self, i: u32, expected: u32) -> io::Result<()> {
        crate::sys::futex_wait(self.word(i), expected)
    }
}

impl AsFd for Segment {
    /// The memory file, to pass to a client.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map` with this address and
        // length, and no reference into it outlives `self`.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

#[cfg(target_os = "linux")]
fn memfd() -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal; the call has no other
    // pointer arguments.
    let fd = unsafe {
        libc::memfd_create(
            c"herdless-segment".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody
    // else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(target_os = "linux")]
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

#[cfg(target_os = "linux")]
fn seal(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS takes an int argument; `fd` is a live descriptor.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn sealed(fd: &OwnedFd) -> io::Result<bool> {
    // SAFETY: F_GET_SEALS takes no argument; `fd` is a live descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(seals & SEALS == SEALS)
}

#[cfg(not(target_os = "linux"))]
fn memfd() -> io::Result<OwnedFd> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "the shared token table needs a sealable memfd (Linux)",
    ))
}

#[cfg(not(target_os = "linux"))]
fn seal(_: &OwnedFd) -> io::Result<()> {
    memfd().map(drop)
}

#[cfg(not(target_os = "linux"))]
fn sealed(_: &OwnedFd) -> io::Result<bool> {
    memfd().map(|_| false)
}

/// Whether this kernel can make a segment: a sealable memory file and a
/// process-shared futex.
pub fn segment_support() -> Result<(), String> {
    crate::wait::Mode::Futex
        .available()
        .map_err(|e| e.to_string())?;
    match memfd() {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("no sealable memory file: {e}")),
    }
}

/// Sends `bytes` on the stream socket `sock` with `fd` attached
/// (`SCM_RIGHTS`) to the first byte. Returns the bytes sent, which may be
/// fewer than given (the descriptor went with the first of them).
///
/// # Errors
///
/// The OS error of `sendmsg` (`WouldBlock` on a full non-blocking socket:
/// nothing was sent).
pub fn send_with_fd(sock: BorrowedFd<'_>, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let iov = [io::IoSlice::new(bytes)];
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    loop {
        // No SIGPIPE for a peer that went away, where the flag exists.
        // Apple systems have none; the shared table, the one user of this,
        // is not offered there.
        #[cfg(not(target_vendor = "apple"))]
        let flags = MsgFlags::MSG_NOSIGNAL;
        #[cfg(target_vendor = "apple")]
        let flags = MsgFlags::empty();
        match sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, flags, None) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

/// Reads from the stream socket `sock` into `buf`, taking a descriptor
/// sent with the bytes (`SCM_RIGHTS`) if there is one; extra descriptors
/// are closed. Returns the bytes read and the descriptor.
///
/// # Errors
///
/// The OS error of `recvmsg`.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    // Close-on-exec as the descriptor arrives, where the flag exists.
    // Apple systems have none: it is set just after, which leaves a window
    // for a concurrent fork and exec; the shared table, the one user of
    // this, is not offered there.
    #[cfg(not(target_vendor = "apple"))]
    let flags = MsgFlags::MSG_CMSG_CLOEXEC;
    #[cfg(target_vendor = "apple")]
    let flags = MsgFlags::empty();
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), flags)
        .map_err(io::Error::from)?;
    let mut got = None;
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for raw in fds {
                // SAFETY: the kernel installed `raw` in this process for
                // this message; nobody else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                #[cfg(target_vendor = "apple")]
                nix::fcntl::fcntl(
                    &owned,
                    nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
                )
                .map_err(io::Error::from)?;
                if got.is_none() {
                    got = Some(owned);
                }
            }
        }
    }
    Ok((msg.bytes, got))
}

/// How many times this process's line has forked since the count began: a
/// handle that records it when it opens can tell, without a system call,
/// whether it is still in the process that opened it (a `getpid` per call
/// would cost one). `None` where the count is not kept (every OS but
/// Linux): compare process ids instead.
///
/// The count is bumped by a `pthread_atfork` child handler registered on
/// the first call, so a fork made by `fork(3)` (and everything built on
/// it) is seen; a raw `clone(2)` that skips the C library's handlers is
/// not.
pub fn fork_generation() -> Option<u64> {
    imp::fork_generation()
}

#[cfg(target_os = "linux")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Once;

    static GENERATION: AtomicU64 = AtomicU64::new(0);
    static REGISTER: Once = Once::new();
    static REGISTERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    extern "C" fn child() {
        // Async-signal-safe: one atomic add, no allocation, no lock.
        GENERATION.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn fork_generation() -> Option<u64> {
        REGISTER.call_once(|| {
            // SAFETY: `child` is an `extern "C"` function with no
            // arguments that only touches a static atomic, which is valid
            // to run in the child of a fork; the other two handlers are
            // absent.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(child)) };
            REGISTERED.store(rc == 0, Ordering::SeqCst);
        });
        REGISTERED
            .load(Ordering::SeqCst)
            .then(|| GENERATION.load(Ordering::SeqCst))
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn fork_generation() -> Option<u64> {
        None
    }
}
