//! Classic jobservers: GNU make's pipe (`--jobserver-auth=R,W`) and fifo
//! (`fifo:PATH`), the older `--jobserver-fds=R,W`, cargo's
//! `CARGO_MAKEFLAGS`, and bmake's `-J R,W`.
//!
//! This module holds the classic jobserver's vocabulary ([`auth`]: how it
//! is named in `MAKEFLAGS`, its flavours and styles, which programs take
//! part), shared by the client, the broker's bridge and the command line,
//! and the mechanics of a classic client: the token pipe (`pipe`) and the
//! job slot of a make recipe (`slot`). The client backend built on them is
//! `client/classic.rs`: when no herdless broker is named (`HERDLESS_SOCKET`
//! is unset), [`Client::from_env`](crate::Client::from_env) falls back to
//! the classic jobserver named in the environment
//! ([`Jobserver::from_env`]), and the whole [`Client`](crate::Client) API
//! works on it.
//!
//! # Taking a token
//!
//! A token is one byte in a pipe shared by every process of the build. The
//! client reads through a file description of its own where the OS can
//! make one (the fifo's path; on Linux `/proc/self/fd/R`), so making it
//! non-blocking changes nothing for the other readers. It waits until the
//! pipe is readable, in the mode that wakes the fewest processes (Linux:
//! `EPOLLEXCLUSIVE`, one registration per wait so the longest waiter wins;
//! elsewhere `poll()`, as every BSD wakes all waiters anyway), then claims
//! the byte with a non-blocking read; `EAGAIN` means another process got it
//! and it waits again. Every return from the wait is followed by a claim,
//! so no wake-up is dropped. The bytes read are kept on a stack and each
//! token gives back exactly the byte it took.
//!
//! Deadlines, signals ([`Client::acquire_interruptible`]) and a caller's
//! own poll loop ([`Client::take_grant`]; the fd to watch is the private
//! read description) all work.
//!
//! [`Client::acquire_interruptible`]: crate::Client::acquire_interruptible
//! [`Client::take_grant`]: crate::Client::take_grant
//!
//! # bmake's abort tokens
//!
//! Under bmake (`-J`), `+` is a token, and `E` (a job failed) or `I`
//! (interrupted) stops the tree. A client that reads one drains the pipe,
//! writes the stopper back so that every other reader sees it, as bmake
//! does, and fails with [`ErrorKind::Aborted`](crate::client::ErrorKind);
//! every later acquire fails the same way, and tokens given back after it
//! become the stopper too. [`Client::abort`](crate::Client::abort) puts the
//! stopper in. GNU make has no abort token: there `abort` returns an
//! [`Unsupported`](crate::client::ErrorKind::Unsupported) error and changes
//! nothing; a failing job's exit status is how GNU make learns of it. Other
//! bytes are tokens under both flavours.
//!
//! # A job of the runner above
//!
//! [`Options::job_of_runner_above`](crate::client::Options::job_of_runner_above) (what
//! `herdless exec` uses) says "this process *is* one job of the runner
//! above it". With a broker, the broker lends that runner's slot, named in
//! `HERDLESS_SLOT` (see [`crate::client`]); a job of a make recipe names the
//! recipe's slot by the recipe root found as below. A classic
//! jobserver has no one to lend it, yet a make recipe already runs in a
//! slot make took for it, and taking a second, pipe, token would deadlock
//! `make -j2` with two such recipes (make holds the only pipe token). The
//! rule:
//!
//! 1. **The parent runs each job in a slot of its own** — its command name
//!    is a make (`make`, `gmake`, `bmake`, `*make`, `make-*`), `ninja`,
//!    `samu` or `cargo`. GNU make runs a simple recipe line without a shell
//!    and a shell runs the last command of `sh -c` with `exec`, so this is
//!    the common case. The process owns that slot: its first token is
//!    taken without touching the pipe, like an implicit token.
//! 2. **Otherwise the parent is part of a recipe** — its shell, a subshell
//!    of it (`(cmd || echo failed) &`), `xargs -P`, a script — and make
//!    gave that whole recipe one slot. The slot belongs to the recipe's
//!    root: the highest ancestor whose own parent is a job runner as in 1
//!    (with none above, the parent itself, e.g. a program that made the
//!    jobserver and spawns jobs of its own). All jobs under that root
//!    share its slot through an exclusive `flock(2)` on a lock file named
//!    after the root's pid and the jobserver's pipe, in a mode-0700
//!    directory of this user (`herdless-slots-UID` under
//!    `$XDG_RUNTIME_DIR`, `$TMPDIR` or `/tmp`). The kernel drops the lock
//!    when its holder dies. The first job takes the slot; the others wait
//!    for *either* the slot or a pipe token, whichever comes first: a helper
//!    thread blocks in `flock(LOCK_EX)` and signals through a pipe watched
//!    beside the token pipe — no timer, no polling. If a pipe token wins, a
//!    lock the helper gets later is given back at once.
//!
//! The ancestors are read from `/proc/PID/stat` on Linux and from one `ps
//! -A -o pid= -o ppid= -o comm=` elsewhere, once, when the client is made.
//!
//! A job in a PID namespace of its own, below a make outside it (a recipe
//! that sandboxes its command: `unshare --pid --fork`, `bwrap
//! --unshare-pid`), cannot see the make: its parent reads 0 (it is the
//! namespace's first process), or `/proc` is another namespace's and names
//! other processes, or the ancestors it sees end at the namespace's first
//! process with no job runner but itself in the whole table. It is then
//! taken as in 1 (the make runs the sandbox in a slot of its own), not as
//! orphaned: orphaned, it would wait for a pipe token while the make holds
//! the recipe's for it, and two such recipes at `-j2` would wait for good
//! (`tests/classic_client_make.rs`, `*_exec_jobs_in_pid_namespaces`). Two
//! such jobs in one sandbox then each run in that slot, one more than the
//! limit, as two stock sub-makes there would. (With a broker outside the
//! namespace, the broker finds the recipe itself: `docs/PROTOCOL.md`,
//! section 6.)
//!
//! Limits: job runners are recognised by name, so a make-like program of
//! another name is taken for part of a recipe (its jobs then share one slot
//! plus the pipe tokens: slower, never over the limit, never deadlocked,
//! since the slot's holder is running its job), and a program named like a
//! make is taken for one (its children may then exceed the limit by one
//! each, as any classic client with an implicit token would). A job of a
//! job — `herdless exec sh -c 'herdless exec a & herdless exec b'` — runs
//! in a slot below the outer `herdless exec`, which counts as a job runner:
//! the outer job only waits for its command, so its command's first job
//! needs no token, and never waits for the slot the outer job holds. A slot held by a thread of this process is not handed to
//! another thread of it that is already waiting (as with the implicit
//! token); it is taken at that thread's next acquire.
//!
//! # Portability
//!
//! - Linux: private descriptions for both styles, `EPOLLEXCLUSIVE`, and
//!   checks of each fd's access mode through `/proc/self/fdinfo`.
//! - BSD and macOS: the fifo style is private; the pipe style is reached
//!   through `/dev/fd/N` (on FreeBSD, fdescfs must be mounted there for
//!   numbers above 2), which shares the description. GNU make ≥ 4.3 and
//!   bmake make their read end non-blocking, which is all a claim needs;
//!   on a blocking shared description (the `jobserver` crate's, older GNU
//!   make) only a plain blocking acquire works, by a blocking `read()` (a
//!   job of the runner above waiting there takes the slot only if it is free when
//!   the wait starts), and the other calls return an
//!   [`Unsupported`](crate::client::ErrorKind::Unsupported) error.
//!
//! # What the classic protocol cannot do
//!
//! A process killed while holding a pipe token takes it with it: nothing
//! can put it back. There is no status report
//! ([`Client::status_json`](crate::Client::status_json) returns
//! `Unsupported`), and readers of the pipe that use `poll()` (make itself)
//! still wake all together.

pub mod auth;
pub(crate) mod pipe;
pub(crate) mod slot;

pub use auth::{without_jobserver, Auth, Flavor, Jobserver, Program, Style, VARS};
