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
    /// The memory file, kept by its maker (to pass it on, and for a death
    /// guard's own mapping); a receiver closes it once mapped, the mapping
    /// keeping the file.
    fd: Option<OwnedFd>,
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
        Segment::map(fd, words, true)
    }

    /// Maps a segment received from its maker, which says it has `words`
    /// table words, and closes `fd`: a receiver spends no descriptor on
    /// the segment it uses ([`file`](Segment::file) is `None`).
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
        Segment::map(fd, words, false)
    }

    fn map(fd: OwnedFd, words: u32, keep: bool) -> io::Result<Segment> {
        let len = byte_len(words);
        let base = map_shared(fd.as_fd(), len)?;
        Ok(Segment {
            base,
            len,
            words,
            fd: keep.then_some(fd),
        })
    }

    /// The memory file, to pass to a client: `Some` for the segment's
    /// maker ([`create`](Segment::create)), `None` for one that
    /// [`open`](Segment::open)ed it.
    pub fn file(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }

    /// Table words.
    #[inline]
    pub fn words(&self) -> u32 {
        self.words
    }

    #[inline]
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
    #[inline]
    pub fn header(&self, i: u32) -> &AtomicU32 {
        assert!(i < HEADER_WORDS, "header word {i} out of range");
        self.at(i as usize)
    }

    /// Table word `i` (`i < words()`).
    ///
    /// # Panics
    ///
    /// When `i` is out of range.
    #[inline]
    pub fn word(&self, i: u32) -> &AtomicU32 {
        assert!(i < self.words, "table word {i} out of range");
        self.at(HEADER_WORDS as usize + i as usize)
    }

    /// Header words `i` and `i + 1` (`i` even, below 15) as one 64-bit
    /// word.
    ///
    /// # Panics
    ///
    /// When `i` is odd or `i + 1` is not a header word.
    #[inline]
    pub fn header64(&self, i: u32) -> &AtomicU64 {
        assert!(
            i % 2 == 0 && i + 1 < HEADER_WORDS,
            "header words {i}, {} out of range",
            i + 1
        );
        // SAFETY: header words `i` and `i + 1` lie inside the mapping at
        // byte offset 4·i from its page-aligned start, 8-aligned for an
        // even `i`, and are only ever accessed atomically, this pair only
        // as this 64-bit atomic.
        unsafe { &*self.base.as_ptr().add(i as usize).cast::<AtomicU64>() }
    }

    /// The 64-bit counter made of header words 8 and 9.
    #[inline]
    pub fn counter64(&self) -> &AtomicU64 {
        // SAFETY: header words 8 and 9 lie inside the mapping at byte
        // offset 32 from its page-aligned start, so the pointer is 8-aligned
        // and 8 bytes are backed; they are only ever accessed as this
        // atomic (`header` refuses nothing there, so the library keeps to
        // this accessor for them).
        unsafe { &*self.base.as_ptr().add(8).cast::<AtomicU64>() }
    }

    /// Table words `i` and `i + 1` as one 64-bit word.
    ///
    /// # Panics
    ///
    /// When `i + 1` is out of range, or word `i` is not 8-aligned in the
    /// mapping.
    pub fn word64(&self, i: u32) -> &AtomicU64 {
        assert!(
            i < self.words.saturating_sub(1),
            "table word {i} out of range"
        );
        let index = HEADER_WORDS as usize + i as usize;
        assert!(index % 2 == 0, "table word {i} is not 8-aligned");
        // SAFETY: words `index` and `index + 1` lie inside the mapping
        // (checked above), whose page-aligned start makes an even index
        // 8-aligned; the mapping is live, backed (sealed) and only ever
        // accessed atomically, this pair only as this 64-bit atomic.
        unsafe { &*self.base.as_ptr().add(index).cast::<AtomicU64>() }
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

    /// Sleeps while table word `i` holds `expected`, for at most `timeout`
    /// (`None`: no limit). `Ok(false)` when the time ran out; `Ok(true)` on
    /// a wake-up, a spurious return, or a word that no longer holds
    /// `expected`: the caller re-checks the word in every case.
    ///
    /// # Errors
    ///
    /// `Interrupted` on a signal whose handler does not restart calls; the
    /// OS error of the wait call.
    pub fn wait_word_for(
        &self,
        i: u32,
        expected: u32,
        timeout: Option<std::time::Duration>,
    ) -> io::Result<bool> {
        imp_wait::futex_wait_for(self.word(i), expected, timeout)
    }

    /// Wakes every process sleeping on table word `i`.
    ///
    /// # Errors
    ///
    /// The OS error of the wake call.
    pub fn wake_all(&self, i: u32) -> io::Result<()> {
        imp_wait::futex_wake_all(self.word(i))
    }

    /// Puts table words `words` under a [`DeathGuard`]: a thread of this
    /// process whose thread id the caller stores in those words, and which
    /// the kernel answers for when this process dies, however it dies.
    ///
    /// # Errors
    ///
    /// `InvalidInput` for more than [`DeathGuard::MAX_WORDS`] words, a word
    /// out of range or not 8-aligned in the mapping; `Unsupported` where the
    /// kernel keeps no robust futex list (everything but Linux); the error
    /// of starting the thread or of `set_robust_list`.
    pub fn guard(&self, words: &[u32]) -> io::Result<DeathGuard> {
        let mut offsets = Vec::with_capacity(words.len());
        for &i in words {
            if i >= self.words {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("table word {i} out of range"),
                ));
            }
            let off = (HEADER_WORDS as usize + i as usize) * std::mem::size_of::<AtomicU32>();
            if off % 8 != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("table word {i} is not 8-aligned"),
                ));
            }
            offsets.push(off);
        }
        if offsets.len() > DeathGuard::MAX_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a guard watches at most {} words", DeathGuard::MAX_WORDS),
            ));
        }
        // The guard maps the file again, on its own: the words it names
        // live as long as it does, whatever happens to this mapping (a
        // futex on a shared file mapping is keyed by file and offset, so
        // a wake through either mapping reaches sleepers on both).
        // The descriptor closes once mapped: the mapping keeps the file,
        // and a broker short of descriptors spends none on its guard.
        let file = self.fd.as_ref().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "a death guard is made by the segment's maker, which keeps its file",
            )
        })?;
        let mine = Mapping::of(file.try_clone()?, self.len)?;
        DeathGuard::start(mine, offsets)
    }
}

/// Futex words that the kernel itself answers for when a process dies.
///
/// A thread of the process registers the words in its robust futex list
/// (`set_robust_list(2)`); the caller stores that thread's id
/// ([`tid`](DeathGuard::tid)) in a word, with bit 31 (`FUTEX_WAITERS`) set
/// while another process may sleep on it. When the thread ends for any
/// reason, a `kill -9` of its process included, the kernel walks the list:
/// every word whose low 30 bits still hold the thread's id gets those bits
/// cleared and bit 30 (`FUTEX_OWNER_DIED`) set, and a sleeper on it is
/// woken when bit 31 was set (the kernel's `handle_futex_death`). So a
/// process asleep on such a word learns of the death without a timer.
///
/// The list and its entries live in this process's private memory, at one
/// fixed distance from the words they name (the list's `futex_offset`), so
/// no other process mapping the segment can change what the kernel walks.
/// When the guard is dropped the thread does the kernel's part itself for
/// every word that still names it (marks it and wakes its sleepers), puts
/// back the C library's list and ends; the segment must outlive the guard.
#[derive(Debug)]
pub struct DeathGuard {
    tid: u32,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The guard's own mapping of the segment, unmapped after the thread
    /// has ended.
    _map: std::sync::Arc<Mapping>,
    /// The process that started the guard: a fork has no guard thread.
    pid: u32,
}

/// Maps the first `len` bytes of the segment file `fd`, shared, read and
/// write.
fn map_shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<NonNull<AtomicU32>> {
    let nz = NonZeroUsize::new(len).expect("a segment is not empty");
    // SAFETY: a new mapping at an address of the kernel's choosing overlaps
    // no Rust object. Every caller maps a file of at least `len` bytes that
    // is sealed against shrinking (checked when the segment was made or
    // opened), so every mapped byte stays backed; the page alignment
    // satisfies AtomicU32's and AtomicU64's alignment.
    let ptr = unsafe {
        mmap(
            None,
            nz,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            0,
        )?
    };
    Ok(ptr.cast())
}

/// A shared mapping of a segment's file that owns no descriptor.
#[derive(Debug)]
struct Mapping {
    base: NonNull<AtomicU32>,
    len: usize,
}

// SAFETY: as for `Segment`: the mapping is process-wide, lives until drop
// and is only accessed atomically.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, then closes `fd`.
    fn of(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
        Ok(Mapping {
            base: map_shared(fd.as_fd(), len)?,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `of` with this address and
        // length, and the guard's thread, the only user of it, has ended.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

/// Bit 31 of a guarded word: a process may sleep on it.
pub const FUTEX_WAITERS: u32 = 0x8000_0000;
/// Bit 30 of a guarded word: the guarding thread ended.
pub const FUTEX_OWNER_DIED: u32 = 0x4000_0000;
/// The bits of a guarded word that hold a thread id.
pub const FUTEX_TID_MASK: u32 = 0x3fff_ffff;

impl DeathGuard {
    /// The most words one guard watches (the kernel walks at most 2048
    /// entries of a list).
    pub const MAX_WORDS: usize = 2000;

    /// The guarding thread's id, as the kernel compares it.
    pub fn tid(&self) -> u32 {
        self.tid
    }

    fn start(map: Mapping, offsets: Vec<usize>) -> io::Result<DeathGuard> {
        imp_guard::kernel_walks_lists()?;
        let map = std::sync::Arc::new(map);
        let (base, len) = (map.base.as_ptr() as usize, map.len);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<io::Result<u32>>();
        let flag = stop.clone();
        let keep = map.clone();
        // The guard only parks: a signal sent to the process is for the
        // host's threads (a wake-up's SIGURG, a child's SIGCHLD).
        let thread = crate::signal::spawn_unsignalled(
            std::thread::Builder::new().name("herdless-guard".into()),
            move || {
                imp_guard::run(base, len, &offsets, &flag, &tx);
                drop(keep);
            },
        )?;
        match rx.recv() {
            Ok(Ok(tid)) => Ok(DeathGuard {
                tid,
                stop,
                thread: Some(thread),
                _map: map,
                pid: std::process::id(),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other("the guard thread ended before it started"))
            }
        }
    }
}

impl Drop for DeathGuard {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A fork's copy: the thread is not in this process. Its
            // mapping is left as it is.
            if let Some(t) = self.thread.take() {
                std::mem::forget(t);
            }
            std::mem::forget(self._map.clone());
            return;
        }
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(target_os = "linux")]
mod imp_wait {
    pub(super) use crate::sys::{futex_wait_for, futex_wake_all};
}

#[cfg(not(target_os = "linux"))]
mod imp_wait {
    use std::io;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(super) fn futex_wait_for(_: &AtomicU32, _: u32, _: Option<Duration>) -> io::Result<bool> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }

    pub(super) fn futex_wake_all(_: &AtomicU32) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
}

#[cfg(target_os = "linux")]
mod imp_guard {
    use std::io;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    use std::sync::mpsc::Sender;

    use super::{FUTEX_OWNER_DIED, FUTEX_TID_MASK, FUTEX_WAITERS};

    /// `struct robust_list_head` of `<linux/futex.h>`.
    #[repr(C)]
    struct Head {
        next: usize,
        futex_offset: libc::c_long,
        list_op_pending: usize,
    }

    fn get_list() -> io::Result<(usize, usize)> {
        let mut head: usize = 0;
        let mut len: libc::size_t = 0;
        // SAFETY: get_robust_list(0, …) writes this thread's head pointer
        // and its length into the two locals, which outlive the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_get_robust_list,
                0 as libc::c_long,
                &mut head as *mut usize,
                &mut len as *mut libc::size_t,
            )
        };
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok((head, len))
    }

    fn set_list(head: usize, len: usize) -> io::Result<()> {
        // SAFETY: the kernel stores the pointer and only reads through it
        // (with user-access checks) when this thread ends; every caller
        // keeps the head and its entries alive and unchanged until this
        // thread has set another list or ended.
        let rc = unsafe { libc::syscall(libc::SYS_set_robust_list, head, len) };
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the kernel walks a thread's robust list when the thread
    /// ends (some emulations accept the list and never walk it): a
    /// scratch thread lists one word holding its id and ends; the word
    /// must then read `FUTEX_OWNER_DIED`. Checked once per process.
    pub(super) fn kernel_walks_lists() -> io::Result<()> {
        static CHECKED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        let unsupported = |e: String| io::Error::new(io::ErrorKind::Unsupported, e);
        if let Some(known) = CHECKED.get() {
            return known.clone().map_err(unsupported);
        }
        let word = Box::new(AtomicU32::new(0));
        let mut entry = Box::new(0usize);
        let mut head = Box::new(Head {
            next: 0,
            futex_offset: 0,
            list_op_pending: 0,
        });
        let word_addr = &*word as *const AtomicU32 as usize;
        let entry_addr = &mut *entry as *mut usize as usize;
        let head_addr = &mut *head as *mut Head as usize;
        *entry = head_addr;
        head.next = entry_addr;
        head.futex_offset = (word_addr as isize).wrapping_sub(entry_addr as isize) as libc::c_long;
        let w = word_addr;
        // A process short of threads learns nothing of the kernel: that
        // is not kept, and the next guard checks again.
        let check = std::thread::Builder::new()
            .name("herdless-check".into())
            .spawn(move || -> io::Result<()> {
                // SAFETY: `w` is the address of the boxed AtomicU32,
                // which the spawning thread keeps alive until after
                // this thread is joined.
                let word = unsafe { &*(w as *const AtomicU32) };
                // SAFETY: gettid has no arguments and cannot fail.
                let tid = unsafe { libc::gettid() } as u32;
                word.store(tid, SeqCst);
                // The C library's list is not put back: this thread
                // ends at once, and its list is the one walked.
                set_list(head_addr, std::mem::size_of::<Head>())
            })?;
        let outcome = check.join();
        let seen = word.load(SeqCst);
        drop((entry, head));
        let known = match outcome {
            Ok(Ok(())) if seen & FUTEX_OWNER_DIED != 0 && seen & FUTEX_TID_MASK == 0 => Ok(()),
            Ok(Ok(())) => Err(format!(
                "the kernel does not walk robust futex lists (word {seen:#x})"
            )),
            Ok(Err(e)) => Err(format!("set_robust_list: {e}")),
            Err(_) => Err("the check's thread panicked".to_owned()),
        };
        CHECKED.get_or_init(|| known).clone().map_err(unsupported)
    }

    pub(super) fn run(
        base: usize,
        len: usize,
        offsets: &[usize],
        stop: &AtomicBool,
        tx: &Sender<io::Result<u32>>,
    ) {
        // The entries mirror the segment: entry k lies at the same offset
        // in `mirror` as its word in the segment, so one futex_offset
        // leads from every entry to its word.
        let mut mirror = vec![0u64; len.div_ceil(8) + 1].into_boxed_slice();
        let mirror_base = mirror.as_mut_ptr() as usize;
        let mut head = Box::new(Head {
            next: 0,
            futex_offset: (base as isize).wrapping_sub(mirror_base as isize) as libc::c_long,
            list_op_pending: 0,
        });
        let head_addr = &*head as *const Head as usize;
        let mut next = head_addr;
        for &off in offsets.iter().rev() {
            mirror[off / 8] = next as u64;
            next = mirror_base + off;
        }
        head.next = next;
        let saved = match get_list() {
            Ok(saved) => saved,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        if let Err(e) = set_list(head_addr, std::mem::size_of::<Head>()) {
            let _ = tx.send(Err(e));
            return;
        }
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = unsafe { libc::gettid() } as u32;
        let _ = tx.send(Ok(tid));
        while !stop.load(SeqCst) {
            std::thread::park();
        }
        // An orderly end: do what the kernel would, then put the C
        // library's list back before the head and entries are freed.
        for &off in offsets {
            // SAFETY: `off` was checked to lie inside the live mapping and
            // to be 8-aligned; the word is only accessed atomically.
            let word = unsafe { &*((base + off) as *const AtomicU32) };
            let mut v = word.load(SeqCst);
            while v & FUTEX_TID_MASK == tid {
                let marked = (v & FUTEX_WAITERS) | FUTEX_OWNER_DIED;
                match word.compare_exchange(v, marked, SeqCst, SeqCst) {
                    Ok(_) => {
                        let _ = super::imp_wait::futex_wake_all(word);
                        break;
                    }
                    Err(now) => v = now,
                }
            }
        }
        let _ = set_list(saved.0, saved.1);
        drop(head);
        drop(mirror);
    }
}

#[cfg(not(target_os = "linux"))]
mod imp_guard {
    use std::io;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc::Sender;

    pub(super) fn kernel_walks_lists() -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a death guard needs the kernel's robust futex list (Linux)",
        ))
    }

    pub(super) fn run(
        _: usize,
        _: usize,
        _: &[usize],
        _: &AtomicBool,
        tx: &Sender<io::Result<u32>>,
    ) {
        let _ = tx.send(Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a death guard needs the kernel's robust futex list (Linux)",
        )));
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
/// A descriptor this process has no room for (its table is full: the
/// kernel drops it and marks the control data truncated, `MSG_CTRUNC`)
/// is not an error: the bytes still count, and no descriptor comes with
/// them. Control data truncated for want of space here (more than four
/// descriptors sent at once, which no broker does) is read the same way;
/// what the kernel installed of it then stays open, close-on-exec.
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
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        // The control data cannot be walked safely (nix refuses it).
        return Ok((msg.bytes, None));
    }
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
#[inline]
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
