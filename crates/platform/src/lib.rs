//! Kernel-facing parts of herdless.
//!
//! Everything here talks to one kernel and is not already in mio: the ways a
//! process can wait for a byte on a shared pipe ([`wait`]), a wake-one word in
//! shared memory ([`SharedWord`]), peer credentials of a Unix socket
//! ([`peer_cred`]), wake-up counting ([`process_ctx_switches`],
//! [`self_rusage`]), a clock shared by all processes ([`monotonic`]),
//! kernel capability detection ([`capabilities`]), the process table
//! ([`ProcessTable`], [`process_state`], [`sched_count`]), questions about
//! a descriptor ([`fd_path`], [`access_mode`], [`is_nonblocking`]) and the
//! descriptor limit of a process serving many clients
//! ([`raise_nofile_limit`]) and waking a process that waits in its own
//! poll loop ([`PollWake`], [`send_wake`]).
//!
//! # Backends
//!
//! The OS backend is chosen once, below, as the private module `sys`:
//! `linux.rs` for Linux, `bsd.rs` for FreeBSD, NetBSD, OpenBSD, DragonFly
//! and Apple systems (which share kqueue), and a `compile_error!` for
//! anything else. Each backend provides the same items, without a trait:
//!
//! - `peer_cred(BorrowedFd) -> io::Result<PeerCred>`
//! - `process_ctx_switches(i32) -> io::Result<CtxSwitches>`
//! - `mode_support(Mode, &Kernel) -> Result<(), String>` for the modes
//!   that depend on the OS (epoll, kqueue), the `Err` being the reason
//! - `futex_support(&Kernel) -> Result<(), String>`,
//!   `futex_wait(&AtomicU32, u32) -> io::Result<()>` (sleeps only while the
//!   word holds the expected value) and
//!   `futex_wake_one(&AtomicU32) -> io::Result<()>`, on a word that other
//!   processes may map
//! - `Poller`, the OS's own readiness queue (epoll or kqueue) for one fd,
//!   with `new(BorrowedFd, Mode, Trigger) -> io::Result<Poller>` and
//!   `wait(&mut self) -> io::Result<()>`
//! - `reopen_pipe(BorrowedFd, nonblocking: bool) ->
//!   io::Result<Option<OwnedFd>>`, a private open file description of a
//!   pipe, where the OS can make one
//! - `exclusive_pipe_read(&Kernel) -> bool`
//!
//! Everything that is the same on every Unix (poll, select, getrusage,
//! uname, the shared mapping) lives in the shared files.
#![warn(missing_docs)]

#[cfg(target_os = "linux")]
#[path = "linux.rs"]
mod sys;

#[cfg(any(
    target_os = "freebsd",
    target_os = "netbsd",
    target_os = "openbsd",
    target_os = "dragonfly",
    target_os = "macos",
    target_os = "ios",
))]
#[path = "bsd.rs"]
mod sys;

#[cfg(not(any(
    target_os = "linux",
    target_os = "freebsd",
    target_os = "netbsd",
    target_os = "openbsd",
    target_os = "dragonfly",
    target_os = "macos",
    target_os = "ios",
)))]
compile_error!("herdless-platform does not support this OS");

mod caps;
mod clock;
mod cred;
mod fair_wait;
mod kernel;
mod nofile;
mod pipe;
mod poll_wake;
mod process;
mod segment;
mod shared_word;
mod signal;
mod system;
mod usage;
pub mod wait;

pub use caps::{capabilities, Capabilities};
pub use clock::monotonic;
pub use cred::{peer_cred, PeerCred};
pub use kernel::{kernel, parse_release, Kernel};
pub use nofile::{
    child_nofile_limit, descriptors_free, descriptors_free_by_opening, open_standard_fds,
    raise_nofile_limit, DescriptorCount, NofileLimit,
};
pub use pipe::{
    access_mode, bytes_readable, fd_access_mode, fd_path, fifo_identity, is_nonblocking,
    pipe_cloexec, pipe_default_size, pipe_one_buffer,
};
pub use poll_wake::{
    poll_wake_support, send_wake, valid_wake_pid, PollWake, MAX_POLL_WAKES, PID_LIMIT, WAKE_SIGNAL,
};
pub use process::{
    current_tid, die_with_parent, in_child_pid_namespace, parse_stat, pid_namespace,
    process_exit_fd, process_state, resident_kib, sched_count, ProcessTable, SchedCount,
};
pub use segment::{
    fork_generation, recv_with_fd, segment_support, send_with_fd, DeathGuard, Segment,
    FUTEX_OWNER_DIED, FUTEX_TID_MASK, FUTEX_WAITERS, HEADER_WORDS, MAX_WORDS,
};
pub use shared_word::{SharedCount, SharedWord};
pub use signal::{sent_by_kernel, signal_ignored, spawn_unsignalled};
pub use system::{
    available_memory, listen_fds, load_average, parent_of, parse_meminfo, parse_stat_ppid,
};
pub use usage::{
    children_rusage, process_ctx_switches, process_ctx_switches_all_threads, self_rusage,
    thread_rusage, CtxSwitches, Usage,
};
