//! The runner's slot, for a client that is a job of the runner above it
//! ([`Options::job_of_runner_above`](crate::client::Options::job_of_runner_above)) under
//! a classic jobserver. See the module docs of [`crate::classic`] for the
//! rule; this file is its mechanism.
//!
//! A shared slot is an exclusive `flock(2)` on a lock file named after the
//! parent's pid and the jobserver's pipe, in a mode-0700 directory of this
//! user. The kernel drops the lock when its holder dies, however it dies.
//! The holder unlinks the file before it unlocks it, and a taker checks,
//! once it holds the lock, that the path still names the file it locked,
//! so a slot is never held twice and lock files do not pile up (one is
//! left only by a holder that was killed; the next taker reuses it).
//!
//! Waiting for the slot and for a pipe token at once: a helper thread blocks
//! in `flock(LOCK_EX)` and, once it holds the lock, writes a byte to a
//! notification pipe that the waiting threads watch beside the jobserver's
//! pipe. No timer, no polling. If a pipe token wins, the thread stays
//! blocked; when it gets the lock later and nobody wants it any more, it
//! gives it back at once.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};

use herdless_platform::ProcessTable;

use super::Program;
use crate::sync::lock;

/// Whether `name` (a process's command name) is a program that starts each
/// job it runs in a job slot of its own ([`Program::runs_each_job_in_a_slot`]:
/// make in its variants, ninja, samurai, cargo, and `herdless exec` itself,
/// whose command is the job it holds a slot for). Their direct children own
/// their slot outright.
pub(crate) fn runs_each_job_in_a_slot(name: &str) -> bool {
    Program::of(std::ffi::OsStr::new(name)).is_some_and(Program::runs_each_job_in_a_slot)
}

/// Whose slot a job of the runner above runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// The parent runs each job in a slot of its own: this process owns it.
    Own,
    /// The slot of this process (the recipe's root, below the make that
    /// started it), shared by all its descendants that are jobs.
    Shared(u32),
    /// No job runner above, though a make started this job's tree: the
    /// tree was orphaned (its recipe ended, or it was put in the
    /// background and reparented to init or a subreaper), or a recipe's
    /// process was started under another parent (`setsid -f`). No slot is
    /// left to share: the job waits for a shared token. A slot per
    /// orphaned parent would let each run one job more than `-j`.
    Orphaned,
}

/// Finds the slot owner from the parent `parent` up, given `ps(pid) ->
/// (ppid, command name)`: `Own` when the parent is a job runner; else the
/// highest ancestor whose own parent is one (the recipe's shell, however
/// many subshells lie between); else, with no job runner above,
/// `Orphaned`; and a parent the table does not show, that parent (a
/// table that cannot be read leaves each recipe's jobs to their shell).
/// A job runner is known by its command name, or by its process id
/// (`runner`: the make that named itself in
/// [`RUNNER_ENV`](crate::client::RUNNER_ENV); the broker, which cannot
/// read a client's environment, names none).
pub(crate) fn slot_owner(
    parent: u32,
    runner: impl Fn(u32) -> bool,
    ps: impl Fn(u32) -> Option<(u32, String)>,
) -> Owner {
    let is_runner = |pid: u32, name: &str| runner(pid) || runs_each_job_in_a_slot(name);
    match ps(parent) {
        Some((_, name)) if is_runner(parent, &name) => return Owner::Own,
        Some(_) => {}
        None => return Owner::Shared(parent),
    }
    let mut pid = parent;
    // A bound, in case a process table read in pieces holds a cycle.
    for _ in 0..128 {
        let Some((ppid, _)) = ps(pid) else { break };
        if ppid <= 1 || ppid == pid {
            break;
        }
        let Some((_, name)) = ps(ppid) else { break };
        if is_runner(ppid, &name) {
            return Owner::Shared(pid);
        }
        pid = ppid;
    }
    Owner::Orphaned
}

/// The slot owner for this process, read from the process table (see
/// [`ProcessTable`]).
///
/// A job in a PID namespace of its own (a recipe's `unshare --pid`,
/// `bwrap --unshare-pid`), with the make outside it, cannot see its
/// recipe: its parent reads 0 (it is the namespace's first process), or
/// `/proc` belongs to another namespace and names other processes, or the
/// tree it sees ends at the namespace's first process with no job runner
/// but itself anywhere in sight. It is then taken as started by the make
/// directly (`Own`: it runs in the token the make holds for its recipe,
/// as a stock sub-make would), not as orphaned: waiting for a shared
/// token while the make holds the recipe's for it, two such recipes at
/// `-j 2` would wait for good. (A client of a broker outside the
/// namespace asks the broker, which sees the whole tree:
/// `crate::client::hello_elsewhere`.)
pub(crate) fn this_slot_owner() -> Owner {
    let table = ProcessTable::read();
    let parent = std::os::unix::process::parent_id();
    if parent == 0 || !table.numbers_as_we_do() {
        return Owner::Own;
    }
    // A make with herdless inside names itself: known whatever its name.
    let runner = crate::client::runner_named_in_env();
    match slot_owner(
        parent,
        |pid| Some(pid) == runner,
        |pid| table.parent_and_name(pid),
    ) {
        Owner::Orphaned
            if herdless_platform::in_child_pid_namespace()
                && !table.any_other_named(runs_each_job_in_a_slot) =>
        {
            Owner::Own
        }
        owner => owner,
    }
}

/// The private directory for slot lock files: `herdless-slots-UID` under
/// `$XDG_RUNTIME_DIR`, `$TMPDIR` or `/tmp`, the first where it can be made
/// (or is there), mode 0700, owned by this user (checked by
/// [`open_private_dir`](crate::rundir::open_private_dir)). Every process
/// of a tree sees the same environment, so they all choose the same one.
/// The error is the first base's when none works.
fn slot_dir() -> io::Result<PathBuf> {
    let uid = nix::unistd::geteuid().as_raw();
    crate::rundir::first_that_works(crate::rundir::runtime_bases(), |base| {
        private_slot_dir(&base.join(format!("herdless-slots-{uid}")))
    })
}

fn private_slot_dir(dir: &Path) -> io::Result<PathBuf> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("cannot create {}: {e}", dir.display()),
            ))
        }
    }
    // Checked through a descriptor: a link or a directory of another
    // user put in its place is refused.
    crate::rundir::open_private_dir(dir, "slot directory")?;
    Ok(dir.to_path_buf())
}

/// A held slot lock. Dropping it unlinks the file, then unlocks it.
#[derive(Debug)]
pub(crate) struct SlotLock {
    flock: Option<Flock<File>>,
    path: PathBuf,
}

impl Drop for SlotLock {
    fn drop(&mut self) {
        // Unlink while still holding the lock: a taker that was blocked on
        // this file then sees that the path is gone and starts over.
        let _ = std::fs::remove_file(&self.path);
        drop(self.flock.take());
    }
}

/// Takes the lock on `path`; with `wait` false, only if it is free now.
fn take_lock(path: &Path, wait: bool) -> io::Result<Option<SlotLock>> {
    let arg = if wait {
        FlockArg::LockExclusive
    } else {
        FlockArg::LockExclusiveNonblock
    };
    loop {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(path)?;
        let mut file = file;
        let locked = loop {
            match Flock::lock(file, arg) {
                Ok(l) => break l,
                Err((f, Errno::EINTR)) => file = f,
                Err((_, Errno::EWOULDBLOCK)) if !wait => return Ok(None),
                Err((_, e)) => return Err(e.into()),
            }
        };
        // The holder unlinks before unlocking: the file we locked may be
        // gone, or replaced by a newer one. Then it is not the slot.
        let ours = locked.metadata()?;
        match std::fs::symlink_metadata(path) {
            Ok(now) if (now.dev(), now.ino()) == (ours.dev(), ours.ino()) => {
                return Ok(Some(SlotLock {
                    flock: Some(locked),
                    path: path.to_path_buf(),
                }))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        // Dropping `locked` unlocks the stale file, without unlinking.
    }
}

/// What the helper thread and the waiting threads share.
#[derive(Default)]
struct Shared {
    /// Threads waiting for the slot.
    wanted: u32,
    /// Whether the helper thread is blocked in flock().
    running: bool,
    /// A lock the helper took for the waiters. The notification pipe holds
    /// one byte exactly while this is `Some`.
    got: Option<SlotLock>,
    /// Why the helper failed, if it did.
    failed: Option<String>,
}

struct Notify {
    read: OwnedFd,
    write: OwnedFd,
}

/// The parent's slot shared with siblings through a lock file.
pub(crate) struct SharedSlot {
    path: PathBuf,
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
}

impl std::fmt::Debug for SharedSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSlot")
            .field("path", &self.path)
            .finish()
    }
}

impl SharedSlot {
    /// The slot of process `parent` on the jobserver whose pipe is `id`.
    pub(crate) fn new(parent: u32, id: (u64, u64)) -> io::Result<SharedSlot> {
        let dir = slot_dir()?;
        let path = dir.join(format!("{parent}-{:x}-{:x}.lock", id.0, id.1));
        let (read, write) = herdless_platform::pipe_cloexec(true)?;
        Ok(SharedSlot {
            path,
            shared: Arc::new(Mutex::new(Shared::default())),
            notify: Arc::new(Notify { read, write }),
        })
    }

    /// The lock file's path.
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the slot if it is free now (or the helper already took it).
    pub(crate) fn try_take(&self) -> io::Result<Option<SlotLock>> {
        if let Some(l) = self.take_got() {
            return Ok(Some(l));
        }
        take_lock(&self.path, false)
    }

    fn take_got(&self) -> Option<SlotLock> {
        let mut st = lock(&self.shared);
        let got = st.got.take();
        if got.is_some() {
            self.drain_notify();
        }
        got
    }

    fn drain_notify(&self) {
        let mut buf = [0u8; 8];
        while let Ok(n) = nix::unistd::read(&self.notify.read, &mut buf) {
            if n == 0 {
                break;
            }
        }
    }

    /// Starts waiting for the slot: makes sure the helper thread is blocked
    /// on the lock. The returned guard stops waiting when dropped.
    pub(crate) fn start_waiting(&self) -> io::Result<SlotWait<'_>> {
        let mut st = lock(&self.shared);
        st.wanted += 1;
        if !st.running && st.got.is_none() {
            st.running = true;
            st.failed = None;
            let path = self.path.clone();
            let shared = Arc::clone(&self.shared);
            let notify = Arc::clone(&self.notify);
            let spawned = herdless_platform::spawn_unsignalled(
                std::thread::Builder::new().name("herdless-slot".into()),
                move || helper(path, shared, notify),
            );
            if let Err(e) = spawned {
                st.running = false;
                st.wanted -= 1;
                return Err(e);
            }
        }
        Ok(SlotWait { slot: self })
    }
}

/// The helper thread: blocks until it holds the lock, then hands it to a
/// waiter, or gives it back at once if nobody waits any more.
fn helper(path: PathBuf, shared: Arc<Mutex<Shared>>, notify: Arc<Notify>) {
    let taken = take_lock(&path, true);
    let mut st = lock(&shared);
    st.running = false;
    match taken {
        Ok(Some(l)) if st.wanted > 0 => {
            st.got = Some(l);
            let _ = nix::unistd::write(&notify.write, b"s");
        }
        Ok(_) => {} // dropped: given back at once
        Err(e) => {
            st.failed = Some(format!("cannot lock {}: {e}", path.display()));
            let _ = nix::unistd::write(&notify.write, b"f");
        }
    }
}

/// A thread's wait for the slot; see [`SharedSlot::start_waiting`].
pub(crate) struct SlotWait<'a> {
    slot: &'a SharedSlot,
}

impl SlotWait<'_> {
    /// Watch this beside the pipe: readable when the slot was taken for the
    /// waiters (or the helper failed).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.slot.notify.read.as_fd()
    }

    /// The slot, if the helper has taken it for the waiters.
    pub(crate) fn take(&self) -> io::Result<Option<SlotLock>> {
        let mut st = lock(&self.slot.shared);
        if let Some(l) = st.got.take() {
            self.slot.drain_notify();
            return Ok(Some(l));
        }
        if let Some(why) = st.failed.take() {
            self.slot.drain_notify();
            return Err(io::Error::other(why));
        }
        Ok(None)
    }
}

impl Drop for SlotWait<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.slot.shared);
        st.wanted -= 1;
        if st.wanted == 0 && st.got.is_some() {
            // Nobody wants it now: give it back.
            st.got = None;
            self.slot.drain_notify();
        }
    }
}

/// The parent's slot as this client sees it.
#[derive(Debug)]
pub(crate) enum ParentSlot {
    /// The parent runs each job in a slot of its own (it is a make): the
    /// slot is this process's, like an implicit token.
    Own(AtomicBool),
    /// The parent is a shell or another program whose children share its
    /// one slot.
    Shared(SharedSlot),
}

/// A slot this client took, as the token holds it.
#[derive(Debug)]
pub(crate) enum Held {
    Own,
    /// Kept for its `Drop`, which gives the lock back.
    Locked(#[allow(dead_code)] SlotLock),
}

impl ParentSlot {
    /// Takes the slot if it is free now.
    pub(crate) fn try_take(&self) -> io::Result<Option<Held>> {
        match self {
            ParentSlot::Own(in_use) => Ok(in_use
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
                .then_some(Held::Own)),
            ParentSlot::Shared(s) => Ok(s.try_take()?.map(Held::Locked)),
        }
    }

    /// Gives a held slot back.
    pub(crate) fn give_back(&self, held: Held) {
        match (self, held) {
            (ParentSlot::Own(in_use), Held::Own) => in_use.store(false, Ordering::Release),
            (_, held) => drop(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_runners_by_name() {
        for n in [
            "make",
            "gmake",
            "bmake",
            "bsdmake",
            "herdless-bmake",
            "mingw32-make",
            "make-4.4.1",
            "ninja",
            "cargo",
            "herdless",
            "/usr/bin/make\n",
        ] {
            assert!(runs_each_job_in_a_slot(n), "{n}");
        }
        for n in [
            "sh", "dash", "bash", "xargs", "parallel", "python3", "makeinfo",
        ] {
            assert!(!runs_each_job_in_a_slot(n), "{n}");
        }
    }

    fn table<'a>(rows: &'a [(u32, u32, &'a str)]) -> impl Fn(u32) -> Option<(u32, String)> + 'a {
        move |pid| {
            rows.iter()
                .find(|r| r.0 == pid)
                .map(|r| (r.1, r.2.to_owned()))
        }
    }

    #[test]
    fn slot_owners() {
        let rows = [
            (1, 0, "init"),
            (10, 1, "bash"),
            (20, 10, "make"),
            (30, 20, "sh"),       // a recipe's shell
            (40, 30, "sh"),       // a subshell of it
            (50, 20, "herdless"), // herdless exec run directly by make
            (60, 50, "sh"),
            (70, 10, "cargo-test"),
            (80, 30, "herdless"), // herdless exec under the recipe's shell
            (90, 80, "sh"),       // the script it runs
        ];
        let t = table(&rows);
        // Run by make itself: its own slot.
        assert_eq!(slot_owner(20, |_| false, &t), Owner::Own);
        // Under the recipe's shell, or a subshell of it: the shell's slot.
        assert_eq!(slot_owner(30, |_| false, &t), Owner::Shared(30));
        assert_eq!(slot_owner(40, |_| false, &t), Owner::Shared(30));
        // Under a herdless exec that runs a script: the script's slot.
        assert_eq!(slot_owner(60, |_| false, &t), Owner::Shared(60));
        // A job of a job whose outer exec holds the recipe shell's slot: a
        // slot of its own below the outer job, never the one the outer job
        // holds (which would wait for ever for the job it is part of).
        assert_eq!(slot_owner(80, |_| false, &t), Owner::Own);
        assert_eq!(slot_owner(90, |_| false, &t), Owner::Shared(90));
        // No job runner above (orphaned, or under another parent): none.
        assert_eq!(slot_owner(70, |_| false, &t), Owner::Orphaned);
        assert_eq!(slot_owner(10, |_| false, &t), Owner::Orphaned);
        // A job reparented to init itself.
        assert_eq!(slot_owner(1, |_| false, &t), Owner::Orphaned);
        // An unknown parent: its pid all the same.
        assert_eq!(slot_owner(99, |_| false, &t), Owner::Shared(99));
    }

    #[test]
    fn a_make_that_names_itself_is_a_runner_whatever_its_name() {
        let rows = [
            (1, 0, "init"),
            (10, 1, "bash"),
            (20, 10, "hbmake"), // a make under a name of its own
            (30, 20, "sh"),     // its recipe's shell
            (40, 30, "sh"),     // a subshell of it
            (50, 40, "hbmake"), // a sub-make that named itself too
            (60, 50, "sh"),
        ];
        let t = table(&rows);
        // By its name alone it is no runner: its recipe's jobs find none.
        assert_eq!(slot_owner(40, |_| false, &t), Owner::Orphaned);
        assert_eq!(slot_owner(20, |_| false, &t), Owner::Orphaned);
        // Named in the environment: its recipe's shell owns the slot.
        assert_eq!(slot_owner(20, |p| p == 20, &t), Owner::Own);
        assert_eq!(slot_owner(30, |p| p == 20, &t), Owner::Shared(30));
        assert_eq!(slot_owner(40, |p| p == 20, &t), Owner::Shared(30));
        // The nearest make names itself for its own jobs.
        assert_eq!(slot_owner(60, |p| p == 50, &t), Owner::Shared(60));
        assert_eq!(slot_owner(50, |p| p == 50, &t), Owner::Own);
        // A name that is no process of the tree changes nothing.
        assert_eq!(slot_owner(40, |p| p == 77, &t), Owner::Orphaned);
    }

    fn test_slot(tag: u64) -> SharedSlot {
        // A pid that is not a real parent: tests do not collide with real
        // lock files.
        SharedSlot::new(u32::MAX, (std::process::id() as u64, tag)).unwrap()
    }

    #[test]
    fn a_slot_is_held_once_and_its_file_removed() {
        let slot = test_slot(1);
        let dir = slot.path().parent().unwrap();
        let mode = std::fs::metadata(dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let first = slot.try_take().unwrap().expect("free");
        assert!(slot.path().exists());
        // A second description in the same process conflicts as another
        // process's would.
        assert!(slot.try_take().unwrap().is_none());
        drop(first);
        assert!(!slot.path().exists());
        let again = slot.try_take().unwrap().expect("free again");
        drop(again);
    }

    #[test]
    fn the_helper_hands_over_the_slot_when_released() {
        let slot = test_slot(2);
        let held = slot.try_take().unwrap().unwrap();
        let wait = slot.start_waiting().unwrap();
        assert!(wait.take().unwrap().is_none());
        drop(held);
        // Block until the notification arrives.
        let mut fds = [nix::poll::PollFd::new(
            wait.fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE).unwrap();
        let got = wait.take().unwrap().expect("handed over");
        drop(wait);
        assert!(slot.try_take().unwrap().is_none(), "still held by `got`");
        drop(got);
        assert!(slot.try_take().unwrap().is_some());
    }

    #[test]
    fn a_late_lock_nobody_wants_is_given_back() {
        let slot = test_slot(3);
        let held = slot.try_take().unwrap().unwrap();
        let wait = slot.start_waiting().unwrap();
        drop(wait); // e.g. a pipe token won
        drop(held);
        // The helper takes the lock and gives it back; either way the slot
        // becomes free without anyone waiting for it.
        let mut free = None;
        while free.is_none() {
            free = slot.try_take().unwrap();
            if free.is_none() {
                // Wait for the helper by waiting for the lock itself.
                let _l = take_lock(slot.path(), true).unwrap();
            }
        }
    }
}
