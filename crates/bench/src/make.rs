//! One make of the build model: runs its jobs as far as job tokens allow.
//!
//! The top make's jobs are sub-make processes; a sub-make's jobs are
//! threads that spin for a fixed number of loop iterations (CPU work, so
//! that they take longer when more run than there are cores, as compilers
//! do). Each make waits for either a job to end or, when it wants a token
//! and may watch for one, a token to arrive.
//!
//! # The classic pipe, after bmake's `Job_TokenWithdraw()`
//!
//! `running` counts the make's running jobs (bmake's `jobTokensRunning`);
//! all but one of them hold a token from the pipe, the remaining one runs
//! in the make's implicit token. To start a job the make reads one byte
//! from the pipe without blocking:
//!
//! - it got one: if nothing runs, it writes the byte back (the job runs in
//!   the implicit token); else the job holds it;
//! - it got none and nothing runs: with **C** (the implicit-token check)
//!   the job starts anyway; without it the make waits;
//! - it got none and something runs: it waits, first sleeping one second
//!   with **R**.
//!
//! Waiting is `poll()` on the make's own job-done pipe, with the token pipe
//! added under **P** while a token is wanted, and bmake's 5-second timeout
//! (`POLL_MSEC`). When a job ends and others still run, its token goes back
//! into the pipe.
//!
//! # Herdless
//!
//! A native client: the implicit token first, then `take_grant()`, whose
//! socket is watched while the request is pending; each job's token is
//! dropped when the job ends. No timeout.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::channel::{open_fifo_read, open_fifo_write};
use super::shared::TOKENS;
use super::WorkerArgs;
use herdless::client::{Client, Options, Token};
use herdless::rundir::SOCKET_NAME;

/// How the makes of one run take tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// A classic pipe. `poll`: P, the pipe is polled while a token is
    /// wanted; `check`: C, a make with nothing running runs one job without
    /// a token; `sleep`: R, a failed read is followed by one second of
    /// sleep.
    Pipe {
        /// P: poll the pipe while a token is wanted.
        poll: bool,
        /// C: the implicit-token check.
        check: bool,
        /// R: sleep a second after a failed read.
        sleep: bool,
    },
    /// Native clients of a broker.
    Herdless,
}

impl Variant {
    /// The seed's eight P C R rows, in its order (000 … 111), then herdless.
    pub fn all() -> Vec<Variant> {
        let mut v: Vec<Variant> = (0..8u8)
            .map(|bits| Variant::Pipe {
                poll: bits & 4 != 0,
                check: bits & 2 != 0,
                sleep: bits & 1 != 0,
            })
            .collect();
        v.push(Variant::Herdless);
        v
    }

    /// "P1C1R0" or "herdless".
    pub fn name(self) -> String {
        match self {
            Variant::Pipe { poll, check, sleep } => format!(
                "P{}C{}R{}",
                u8::from(poll),
                u8::from(check),
                u8::from(sleep)
            ),
            Variant::Herdless => "herdless".to_owned(),
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl FromStr for Variant {
    type Err = String;

    fn from_str(s: &str) -> Result<Variant, String> {
        if s.eq_ignore_ascii_case("herdless") {
            return Ok(Variant::Herdless);
        }
        let b = s.as_bytes();
        let bit = |c: u8| match c {
            b'0' => Some(false),
            b'1' => Some(true),
            _ => None,
        };
        if b.len() == 6
            && b[0].eq_ignore_ascii_case(&b'P')
            && b[2].eq_ignore_ascii_case(&b'C')
            && b[4].eq_ignore_ascii_case(&b'R')
        {
            if let (Some(poll), Some(check), Some(sleep)) = (bit(b[1]), bit(b[3]), bit(b[5])) {
                return Ok(Variant::Pipe { poll, check, sleep });
            }
        }
        Err(format!(
            "unknown variant {s:?}; expected P0C0R0 … P1C1R1 (P: poll the pipe, C: \
             implicit-token check, R: sleep after a failed read) or herdless"
        ))
    }
}

/// bmake's `POLL_MSEC`: how long a classic make's poll waits at most.
const CLASSIC_POLL_MS: u16 = 5000;

/// Spins for `iters` iterations of a loop the optimizer cannot remove.
pub(crate) fn spin(iters: u64) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..iters {
        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
    }
    x
}

pub(super) fn main(args: &WorkerArgs) -> io::Result<()> {
    let role: String = args.get("role")?;
    let count: u32 = args.get("count")?;
    let max_jobs: u32 = args.get("j")?;
    let spin_iters: u64 = args.get("spin")?;
    let sub_count: u32 = args.get("sub-count")?;
    let variant: Variant = args
        .get::<String>("variant")?
        .parse()
        .map_err(|e: String| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let dir = PathBuf::from(args.os("dir")?);
    super::procs::die_with_parent();
    let job = match role.as_str() {
        "top" => Job::SubMake {
            exe: std::env::current_exe()?,
            count: sub_count,
        },
        "sub" => Job::Spin(spin_iters),
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("unknown make role {other}"),
            ))
        }
    };
    let source = Source::open(variant, &dir)?;
    Make {
        source,
        job,
        max_jobs,
        spin_iters,
        variant,
        dir,
    }
    .run(count)
}

/// What one job of this make does.
enum Job {
    Spin(u64),
    SubMake { exe: PathBuf, count: u32 },
}

struct Make {
    source: Source,
    job: Job,
    max_jobs: u32,
    spin_iters: u64,
    variant: Variant,
    dir: PathBuf,
}

enum Withdraw {
    Start,
    /// Wants a token and may wait for one.
    Wait,
    /// Runs as many jobs as it may.
    Full,
}

impl Make {
    fn run(mut self, count: u32) -> io::Result<()> {
        let (done_r, done_w) = nix::unistd::pipe()?;
        let mut done_r = File::from(done_r);
        nix::fcntl::fcntl(
            &done_r,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )?;
        let done_w = Arc::new(File::from(done_w));
        let failed = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (mut left, mut running, mut next) = (count, 0u32, 0u32);
        let mut pending = Vec::new();
        loop {
            let mut want = false;
            while left > 0 {
                match self.source.withdraw(next, running, self.max_jobs)? {
                    Withdraw::Start => {
                        threads.push(self.start(next, done_w.clone(), failed.clone())?);
                        next += 1;
                        left -= 1;
                        running += 1;
                    }
                    Withdraw::Wait => {
                        want = true;
                        break;
                    }
                    Withdraw::Full => break,
                }
            }
            if left == 0 {
                self.source.done_wanting()?;
            }
            if left == 0 && running == 0 {
                break;
            }
            let token_fd = if want { self.source.wait_fd() } else { None };
            let mut fds = vec![PollFd::new(done_r.as_fd(), PollFlags::POLLIN)];
            fds.extend(token_fd.map(|fd| PollFd::new(fd, PollFlags::POLLIN)));
            match nix::poll::poll(&mut fds, self.source.timeout()) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
            drop(fds);
            let mut buf = [0u8; 4096];
            loop {
                match done_r.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => pending.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            let whole = pending.len() / 4 * 4;
            for chunk in pending[..whole].chunks_exact(4) {
                let job = u32::from_le_bytes(chunk.try_into().expect("four bytes"));
                running -= 1;
                self.source.token_return(job, running)?;
            }
            pending.drain(..whole);
        }
        for t in threads {
            let _ = t.join();
        }
        if failed.load(Ordering::Relaxed) {
            return Err(io::Error::other("a sub-make failed"));
        }
        Ok(())
    }

    fn start(
        &self,
        idx: u32,
        done: Arc<File>,
        failed: Arc<AtomicBool>,
    ) -> io::Result<thread::JoinHandle<()>> {
        let work = match &self.job {
            Job::Spin(iters) => Err(*iters),
            Job::SubMake { exe, count } => {
                let mut cmd = Command::new(exe);
                cmd.args(make_args(
                    "sub",
                    *count,
                    0,
                    self.max_jobs,
                    self.spin_iters,
                    self.variant,
                    &self.dir,
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
                Ok(cmd)
            }
        };
        thread::Builder::new()
            .name(format!("job-{idx}"))
            .spawn(move || {
                match work {
                    Err(iters) => {
                        spin(iters);
                    }
                    Ok(mut cmd) => match cmd.status() {
                        Ok(s) if s.success() => {}
                        _ => failed.store(true, Ordering::Relaxed),
                    },
                }
                // Four bytes: one atomic write to the make's own pipe.
                if (&*done).write_all(&idx.to_le_bytes()).is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
            })
    }
}

/// The worker command line of a make.
pub(crate) fn make_args(
    role: &str,
    count: u32,
    sub_count: u32,
    max_jobs: u32,
    spin_iters: u64,
    variant: Variant,
    dir: &Path,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec!["bench".into(), "worker".into(), "make".into()];
    for (k, v) in [
        ("--role", role.to_owned()),
        ("--count", count.to_string()),
        ("--sub-count", sub_count.to_string()),
        ("--j", max_jobs.to_string()),
        ("--spin", spin_iters.to_string()),
        ("--variant", variant.name()),
    ] {
        args.push(k.into());
        args.push(v.into());
    }
    args.push("--dir".into());
    args.push(dir.as_os_str().to_owned());
    args
}

enum Source {
    Pipe {
        read: File,
        write: File,
        poll: bool,
        check: bool,
        sleep: bool,
    },
    Herdless {
        client: Client,
        implicit_free: bool,
        held: HashMap<u32, Token>,
        pending: bool,
    },
}

impl Source {
    fn open(variant: Variant, dir: &Path) -> io::Result<Source> {
        match variant {
            Variant::Pipe { poll, check, sleep } => {
                let path = dir.join(TOKENS);
                Ok(Source::Pipe {
                    read: open_fifo_read(&path, true)?,
                    write: open_fifo_write(&path, true)?,
                    poll,
                    check,
                    sleep,
                })
            }
            Variant::Herdless => Ok(Source::Herdless {
                client: Client::connect_with(dir.join(SOCKET_NAME), Options::default())
                    .map_err(io::Error::other)?,
                implicit_free: true,
                held: HashMap::new(),
                pending: false,
            }),
        }
    }

    fn withdraw(&mut self, job: u32, running: u32, max: u32) -> io::Result<Withdraw> {
        if running >= max {
            return Ok(Withdraw::Full);
        }
        match self {
            Source::Pipe {
                read,
                write,
                check,
                sleep,
                ..
            } => {
                let mut byte = [0u8; 1];
                match read.read(&mut byte) {
                    Ok(1) => {
                        if running == 0 {
                            // Not wanted after all: the implicit token will do.
                            write.write_all(&byte)?;
                        }
                        Ok(Withdraw::Start)
                    }
                    Ok(_) => Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the token pipe has no writer left",
                    )),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if *check && running == 0 {
                            return Ok(Withdraw::Start);
                        }
                        if *sleep {
                            thread::sleep(Duration::from_secs(1));
                        }
                        Ok(Withdraw::Wait)
                    }
                    Err(e) => Err(e),
                }
            }
            Source::Herdless {
                client,
                implicit_free,
                held,
                pending,
            } => {
                let token = if *implicit_free {
                    *implicit_free = false;
                    client.try_acquire().map_err(io::Error::other)?
                } else {
                    let t = client.take_grant().map_err(io::Error::other)?;
                    *pending = t.is_none();
                    t
                };
                match token {
                    Some(t) => {
                        held.insert(job, t);
                        Ok(Withdraw::Start)
                    }
                    None => Ok(Withdraw::Wait),
                }
            }
        }
    }

    fn token_return(&mut self, job: u32, running_after: u32) -> io::Result<()> {
        match self {
            Source::Pipe { write, .. } => {
                if running_after != 0 {
                    write.write_all(b"+")?;
                }
                Ok(())
            }
            Source::Herdless {
                held,
                implicit_free,
                ..
            } => {
                if let Some(t) = held.remove(&job) {
                    if t.is_implicit() {
                        *implicit_free = true;
                    }
                    t.release().map_err(io::Error::other)?;
                }
                Ok(())
            }
        }
    }

    fn wait_fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Source::Pipe { read, poll, .. } => poll.then(|| read.as_fd()),
            Source::Herdless {
                client, pending, ..
            } => pending.then(|| client.as_fd()),
        }
    }

    fn timeout(&self) -> PollTimeout {
        match self {
            Source::Pipe { .. } => PollTimeout::from(CLASSIC_POLL_MS),
            Source::Herdless { .. } => PollTimeout::NONE,
        }
    }

    /// Withdraws a request nobody needs any more.
    fn done_wanting(&mut self) -> io::Result<()> {
        if let Source::Herdless {
            client, pending, ..
        } = self
        {
            if *pending {
                *pending = false;
                if let Some(t) = client.cancel_pending().map_err(io::Error::other)? {
                    t.release().map_err(io::Error::other)?;
                }
            }
        }
        Ok(())
    }
}
