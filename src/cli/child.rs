//! Running a command as a child: spawn, pass signals on, map its status.
//!
//! - Signals ignored when herdless starts (SIGHUP under `nohup`, SIGINT in
//!   a shell's background job) stay ignored, for herdless and the command.
//! - A signal sent to herdless by another process is passed on to the
//!   command. One the terminal sends (Ctrl-C) reaches the command directly,
//!   through the process group, so it is not sent a second time.
//! - When the command dies of a signal that herdless received too,
//!   herdless dies of it as well once it has cleaned up, so a shell running
//!   it sees an interrupted job, not an ordinary exit status, and stops.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::iterator::exfiltrator::WithRawSiginfo;
use signal_hook::iterator::SignalsInfo;

/// The signals `run` and `exec` pass on to their command: every signal
/// whose default action ends a process and that can be caught, so that
/// herdless, ended by one, still cleans up (`run`'s broker stops granting
/// at once and gives back every byte borrowed from an outer jobserver)
/// before it dies of it.
///
/// Not caught: SIGKILL and SIGSTOP, which cannot be; SIGPIPE, ignored in
/// this process as in every Rust program (so a broken stdout kills
/// nothing; the command gets the default back); the signals of a fault of
/// this process itself (SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGSEGV, SIGSYS,
/// SIGTRAP), which a handler would hide; and on Linux SIGIO, SIGPWR,
/// SIGSTKFLT and the real-time signals, which herdless could not die of
/// in turn (`nix::sys::signal::Signal` and signal-hook's default-handler
/// emulation do not know all of them).
const FORWARDED: [i32; 11] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
    libc::SIGVTALRM,
    libc::SIGPROF,
    libc::SIGXCPU,
    libc::SIGXFSZ,
];

/// How the command ended, or why it never started.
pub enum Outcome {
    Exited {
        status: ExitStatus,
        /// The last forwarded signal herdless itself received.
        received: Option<i32>,
    },
    /// Exit code 126 or 127, with the message already printed.
    NotStarted(u8),
}

/// How herdless itself ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Code(u8),
    /// Die of this signal (after cleaning up), as the command did.
    Signal(i32),
}

impl Outcome {
    /// The exit code herdless passes on: the command's status, 128 + N
    /// when it was killed by signal N.
    pub fn code(&self) -> u8 {
        match self {
            Outcome::NotStarted(code) => *code,
            Outcome::Exited { status, .. } => match (status.code(), status.signal()) {
                (Some(code), _) => code as u8,
                (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
                (None, None) => super::EXIT_FAILURE,
            },
        }
    }

    /// How herdless should end: of the command's signal when herdless
    /// received that signal too, otherwise with [`Outcome::code`].
    pub fn exit(&self) -> Exit {
        match self {
            Outcome::Exited {
                status,
                received: Some(got),
            } if status.signal() == Some(*got) => Exit::Signal(*got),
            _ => Exit::Code(self.code()),
        }
    }
}

/// Spawns `argv` with `env` added, passes the [`FORWARDED`] signals on to
/// it while it runs, and waits for it.
/// Catches the signals in `FORWARDED`, except those this process ignores:
/// they stay ignored (and a command inherits SIG_IGN).
fn stop_signals() -> Result<SignalsInfo<WithRawSiginfo>> {
    let watched: Vec<i32> = FORWARDED
        .into_iter()
        .filter(|&sig| !herdless_platform::signal_ignored(sig).unwrap_or(false))
        .collect();
    SignalsInfo::<WithRawSiginfo>::new(&watched).context("cannot catch signals to pass them on")
}

pub fn run(argv: &[OsString], env: &[(&str, OsString)]) -> Result<Outcome> {
    run_inheriting(argv, env, Vec::new(), |_| {}, || {})
}

/// [`run`], with `inherit`: descriptors (without close-on-exec) that the
/// command inherits and that this process closes once it is spawned;
/// `on_spawn`, called with the command's process id once it is spawned;
/// and `on_signal`, called for each forwarded signal herdless receives,
/// before it is passed on.
pub fn run_inheriting(
    argv: &[OsString],
    env: &[(&str, OsString)],
    inherit: Vec<OwnedFd>,
    on_spawn: impl FnOnce(u32),
    on_signal: impl Fn() + Send + 'static,
) -> Result<Outcome> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| anyhow!("no command given"))?;
    // Register before spawning so that no signal slips between the two.
    let mut signals = stop_signals()?;
    let handle = signals.handle();
    let mut cmd = Command::new(program);
    cmd.args(args);
    if let Some(limit) = super::NOFILE.get() {
        herdless_platform::child_nofile_limit(&mut cmd, *limit);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    // The thread that passes signals on starts before the command does:
    // once the command runs, nothing may fail before it is waited for
    // (a process short of threads would leave it running unwatched, on a
    // token given back).
    let received = Arc::new(AtomicI32::new(0));
    let (pid_tx, pid_rx) = std::sync::mpsc::channel::<Pid>();
    let forwarder = {
        let received = received.clone();
        std::thread::Builder::new()
            .name("herdless-signals".into())
            .spawn(move || {
                // No command, no signal to pass on (a signal that came
                // meanwhile waits in `signals`).
                let Ok(pid) = pid_rx.recv() else { return };
                for info in signals.forever() {
                    received.store(info.si_signo, Ordering::SeqCst);
                    on_signal();
                    // The terminal signals the whole process group itself.
                    if herdless_platform::sent_by_kernel(info.si_code) {
                        continue;
                    }
                    if let Ok(sig) = Signal::try_from(info.si_signo) {
                        let _ = kill(pid, sig);
                    }
                }
            })
    };
    let forwarder = match forwarder {
        Ok(thread) => thread,
        Err(e) => {
            handle.close();
            eprintln!(
                "herdless: cannot run {}: cannot start a thread to pass signals on: {e}",
                program.to_string_lossy()
            );
            return Ok(Outcome::NotStarted(126));
        }
    };
    let spawned = cmd.spawn();
    drop(inherit);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            handle.close();
            drop(pid_tx);
            let _ = forwarder.join();
            let code = match e.kind() {
                io::ErrorKind::NotFound => 127,
                _ => 126,
            };
            eprintln!("herdless: cannot run {}: {e}", program.to_string_lossy());
            return Ok(Outcome::NotStarted(code));
        }
    };
    let pid = Pid::from_raw(child.id() as i32);
    let _ = pid_tx.send(pid);
    on_spawn(child.id());
    let status = child.wait();
    handle.close();
    let _ = forwarder.join();
    let received = match received.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    };
    Ok(Outcome::Exited {
        status: status?,
        received,
    })
}

/// Runs `wait` with the stop signals `run_inheriting` forwards caught (the
/// ignored ones left ignored): each one calls `on_signal`, which must make
/// `wait` return soon. Returns what `wait` returned and the last signal
/// received, if any. For the time after the command has ended, when there
/// is nobody left to forward a signal to.
pub fn catching_stops<T>(
    on_signal: impl Fn() + Send + Sync + 'static,
    wait: impl FnOnce() -> T,
) -> Result<(T, Option<i32>)> {
    let mut signals = stop_signals()?;
    let handle = signals.handle();
    let received = Arc::new(AtomicI32::new(0));
    let on_signal = Arc::new(on_signal);
    let catcher = {
        let received = received.clone();
        let on_signal = on_signal.clone();
        std::thread::Builder::new()
            .name("herdless-signals".into())
            .spawn(move || {
                for info in signals.forever() {
                    received.store(info.si_signo, Ordering::SeqCst);
                    on_signal();
                }
            })
    };
    let catcher = match catcher {
        Ok(thread) => thread,
        Err(e) => {
            // No signal could end a wait that may be long (sub-makes left
            // in the background): end it at once, as a signal would.
            handle.close();
            eprintln!("herdless: warning: cannot start a thread to catch signals: {e}");
            on_signal();
            return Ok((wait(), None));
        }
    };
    let value = wait();
    handle.close();
    let _ = catcher.join();
    let got = match received.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    };
    Ok((value, got))
}

/// Ends this process as `exit` says; for a signal, by its default action.
pub fn end(exit: Exit) -> u8 {
    match exit {
        Exit::Code(code) => code,
        Exit::Signal(sig) => {
            let _ = signal_hook::low_level::emulate_default_handler(sig);
            // Only reached if the signal does not end the process.
            128u8.wrapping_add(sig as u8)
        }
    }
}
