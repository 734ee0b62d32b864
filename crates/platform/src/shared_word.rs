//! A wake-one counter in shared memory: the futex wait mode.

use std::fs::OpenOptions;
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::stat::fstat;

use crate::sys;
use crate::wait::Mode;

const WORD_LEN: usize = std::mem::size_of::<AtomicU32>();

/// A 32-bit token counter in a `MAP_SHARED` mapping of a file, with a
/// wake-one futex on it.
///
/// Processes that map the same file — unrelated ones too, started with
/// `Command` and given the path or the descriptor — share the counter.
/// [`post`](SharedWord::post) adds a token and wakes one sleeper;
/// [`take`](SharedWord::take) removes one, sleeping while there is none.
/// No wake-up is lost: a taker sleeps only if the word still reads 0 at the
/// moment the kernel queues it, and the kernel checks that atomically with
/// the post's increment-then-wake.
///
/// The file holds the counter as a native-endian `u32` at offset 0.
///
/// # Portability
///
/// Linux (`FUTEX_WAIT`/`FUTEX_WAKE` on a shared futex), FreeBSD
/// (`_umtx_op(UMTX_OP_WAIT_UINT / UMTX_OP_WAKE)`, the process-shared
/// variants) and NetBSD 10 and later (`__futex`). Elsewhere every
/// constructor fails with `Unsupported`; see [`Mode::available`].
///
/// Shrinking the file below 4 bytes while it is mapped makes the next
/// access raise `SIGBUS`, as with any file mapping.
#[derive(Debug)]
pub struct SharedWord {
    mapped: MappedWord,
}

/// A 32-bit count in a `MAP_SHARED` mapping of a file that processes take
/// from without ever sleeping: a budget several processes draw on, e.g. a
/// benchmark's "how many more grants" that each waiter decrements.
///
/// Unlike [`SharedWord`] it needs no futex, so it works on every Unix.
/// The file holds the count as a native-endian `u32` at offset 0.
#[derive(Debug)]
pub struct SharedCount {
    mapped: MappedWord,
}

/// The first word of a file, mapped shared; unmapped when dropped.
#[derive(Debug)]
struct MappedWord {
    word: NonNull<AtomicU32>,
    fd: OwnedFd,
}

// SAFETY: the mapping is process-wide and lives until drop; the only access
// to it is through `&AtomicU32`, which is `Sync`. Moving the owner to
// another thread moves nothing the mapping depends on.
unsafe impl Send for MappedWord {}
// SAFETY: as above; all operations through `&self` are atomic.
unsafe impl Sync for MappedWord {}

impl MappedWord {
    /// Creates the file at `path` (mode 0600, which must not exist yet),
    /// sized to one word, and maps it. The word starts at 0.
    fn create(path: &Path) -> io::Result<MappedWord> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(WORD_LEN as u64)?;
        MappedWord::from_fd(file.into())
    }

    fn open(path: &Path) -> io::Result<MappedWord> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        MappedWord::from_fd(file.into())
    }

    fn from_fd(fd: OwnedFd) -> io::Result<MappedWord> {
        let st = fstat(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a shared word must live in a regular file",
            ));
        }
        if st.st_size < WORD_LEN as libc::off_t {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a shared word needs a file of at least {WORD_LEN} bytes; this one has {}",
                    st.st_size
                ),
            ));
        }
        let len = NonZeroUsize::new(WORD_LEN).expect("a word is not empty");
        // SAFETY: a new mapping at an address of the kernel's choosing
        // overlaps no Rust object. The file is at least WORD_LEN bytes long,
        // so the mapped word is backed; its page alignment satisfies
        // AtomicU32's alignment.
        let ptr = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )?
        };
        Ok(MappedWord {
            word: ptr.cast(),
            fd,
        })
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: `word` points to a live, aligned, readable and writable
        // mapping that stays until `self` drops, and is only ever accessed
        // atomically, by this and other processes.
        unsafe { self.word.as_ref() }
    }
}

impl Drop for MappedWord {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `from_fd` with this address and
        // length, and no reference into it outlives `self`.
        let _ = unsafe { munmap(self.word.cast(), WORD_LEN) };
    }
}

impl SharedCount {
    /// Creates the file at `path` (mode 0600, which must not exist yet)
    /// and maps it, holding `count`.
    ///
    /// # Errors
    ///
    /// `AlreadyExists` when `path` exists; the OS error of `open()`,
    /// `ftruncate()` or `mmap()`.
    pub fn create(path: impl AsRef<Path>, count: u32) -> io::Result<SharedCount> {
        let mapped = MappedWord::create(path.as_ref())?;
        mapped.word().store(count, Ordering::Release);
        Ok(SharedCount { mapped })
    }

    /// Opens and maps an existing file made by
    /// [`create`](SharedCount::create).
    ///
    /// # Errors
    ///
    /// `InvalidInput` when `path` is not a regular file, `InvalidData`
    /// when it is shorter than 4 bytes, the OS error of `open()`,
    /// `fstat()` or `mmap()`.
    pub fn open(path: impl AsRef<Path>) -> io::Result<SharedCount> {
        Ok(SharedCount {
            mapped: MappedWord::open(path.as_ref())?,
        })
    }

    /// Takes one from the count if it is above 0; `false` when it is 0.
    pub fn take_one(&self) -> bool {
        self.take_one_left().is_some()
    }

    /// Takes one from the count if it is above 0: what is left after it
    /// (0 for the taker of the last one); `None` when it was 0.
    pub fn take_one_left(&self) -> Option<u32> {
        self.mapped
            .word()
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| v.checked_sub(1))
            .ok()
            .map(|was| was - 1)
    }

    /// What is left. Stale as soon as it returns.
    pub fn value(&self) -> u32 {
        self.mapped.word().load(Ordering::Acquire)
    }
}

impl SharedWord {
    /// Creates the file at `path` (mode 0600, which must not exist yet),
    /// sized to one word, and maps it. The counter starts at 0.
    ///
    /// # Errors
    ///
    /// `AlreadyExists` when `path` exists (a live file may be in use by
    /// other processes, and truncating it under them would crash them);
    /// `Unsupported` where the OS has no shared futex; the OS error of
    /// `open()`, `ftruncate()` or `mmap()`.
    pub fn create(path: impl AsRef<Path>) -> io::Result<SharedWord> {
        Mode::Futex.available()?;
        Ok(SharedWord {
            mapped: MappedWord::create(path.as_ref())?,
        })
    }

    /// Opens and maps an existing file made by [`create`](SharedWord::create).
    ///
    /// # Errors
    ///
    /// As [`from_fd`](SharedWord::from_fd), plus the OS error of `open()`.
    pub fn open(path: impl AsRef<Path>) -> io::Result<SharedWord> {
        Mode::Futex.available()?;
        Ok(SharedWord {
            mapped: MappedWord::open(path.as_ref())?,
        })
    }

    /// `mmap(MAP_SHARED)` of the first word of `fd`, a regular file (or a
    /// memfd) open for reading and writing, e.g. one inherited from a
    /// parent.
    ///
    /// # Errors
    ///
    /// `InvalidInput` when `fd` is not a regular file, `InvalidData` when
    /// it is shorter than 4 bytes, `Unsupported` where the OS has no shared
    /// futex, and the OS error of `fstat()` or `mmap()` (`EACCES` when it
    /// is not open for both reading and writing).
    pub fn from_fd(fd: OwnedFd) -> io::Result<SharedWord> {
        Mode::Futex.available()?;
        Ok(SharedWord {
            mapped: MappedWord::from_fd(fd)?,
        })
    }

    fn word(&self) -> &AtomicU32 {
        self.mapped.word()
    }

    /// The number of tokens now in the word. Stale as soon as it returns.
    pub fn value(&self) -> u32 {
        self.word().load(Ordering::Acquire)
    }

    /// Adds one token and wakes at most one sleeping taker.
    ///
    /// An atomic increment, then `futex(FUTEX_WAKE, 1)` on Linux,
    /// `_umtx_op(UMTX_OP_WAKE, 1)` on FreeBSD, `__futex(FUTEX_WAKE, 1)` on
    /// NetBSD. The wake is made whether or not anyone sleeps.
    ///
    /// # Errors
    ///
    /// An `Other` error when the word already holds `u32::MAX` tokens (the
    /// word is left unchanged); the OS error of the wake call.
    pub fn post(&self) -> io::Result<()> {
        self.word()
            .fetch_update(Ordering::Release, Ordering::Relaxed, |v| v.checked_add(1))
            .map_err(|_| {
                io::Error::other("shared word overflow: it already holds u32::MAX tokens")
            })?;
        sys::futex_wake_one(self.word())
    }

    /// Takes one token if there is one, without sleeping.
    pub fn try_take(&self) -> bool {
        self.word()
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |v| v.checked_sub(1))
            .is_ok()
    }

    /// Takes one token, sleeping while the word reads 0.
    ///
    /// A compare-and-swap loop that decrements the word when it is above
    /// 0; at 0 it sleeps in `futex(FUTEX_WAIT, 0)` (or `_umtx_op`/`__futex`)
    /// with 0 as the expected value, so a post that lands between the check
    /// and the sleep makes the sleep return at once. A wake-up whose token
    /// another taker got first goes back to sleep. Signals (`EINTR`) are
    /// retried; use [`take_interruptible`](SharedWord::take_interruptible)
    /// to see them.
    ///
    /// # Errors
    ///
    /// The OS error of the wait call, other than `EINTR`.
    pub fn take(&self) -> io::Result<()> {
        loop {
            match self.take_interruptible() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// As [`take`](SharedWord::take), but returns an `Interrupted` error
    /// when a signal interrupts the sleep.
    ///
    /// # Errors
    ///
    /// As [`take`](SharedWord::take), plus `Interrupted`.
    pub fn take_interruptible(&self) -> io::Result<()> {
        while !self.try_take() {
            sys::futex_wait(self.word(), 0)?;
        }
        Ok(())
    }
}

impl AsFd for SharedWord {
    /// The mapped file, e.g. to hand to a child process.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.mapped.fd.as_fd()
    }
}
