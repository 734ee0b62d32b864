//! Running a command as a child: spawn, forward signals, map its status.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};

use anyhow::{anyhow, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// The signals `run` and `exec` pass on to their command.
const FORWARDED: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];

/// How the command ended, or why it never started.
pub enum Outcome {
    Exited(ExitStatus),
    /// Exit code 126 or 127, with the message already printed.
    NotStarted(u8),
}

impl Outcome {
    /// The exit code herdless passes on: the command's status, 128 + N
    /// when it was killed by signal N.
    pub fn code(&self) -> u8 {
        match self {
            Outcome::NotStarted(code) => *code,
            Outcome::Exited(status) => match (status.code(), status.signal()) {
                (Some(code), _) => code as u8,
                (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
                (None, None) => super::EXIT_FAILURE,
            },
        }
    }
}

/// Spawns `argv` with `env` added, passes SIGINT, SIGTERM and SIGHUP on
/// to it while it runs, and waits for it.
pub fn run(argv: &[OsString], env: &[(&str, OsString)]) -> Result<Outcome> {
    run_inheriting(argv, env, Vec::new())
}

/// [`run`], with `inherit`: descriptors (without close-on-exec) that the
/// command inherits and that this process closes once it is spawned.
pub fn run_inheriting(
    argv: &[OsString],
    env: &[(&str, OsString)],
    inherit: Vec<OwnedFd>,
) -> Result<Outcome> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| anyhow!("no command given"))?;
    // Register before spawning so that no signal slips between the two.
    let mut signals = Signals::new(FORWARDED)?;
    let handle = signals.handle();
    let mut cmd = Command::new(program);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let spawned = cmd.spawn();
    drop(inherit);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            handle.close();
            let code = match e.kind() {
                io::ErrorKind::NotFound => 127,
                _ => 126,
            };
            eprintln!("herdless: cannot run {}: {e}", program.to_string_lossy());
            return Ok(Outcome::NotStarted(code));
        }
    };
    let pid = Pid::from_raw(child.id() as i32);
    let forwarder = std::thread::spawn(move || {
        for sig in signals.forever() {
            if let Ok(sig) = Signal::try_from(sig) {
                let _ = kill(pid, sig);
            }
        }
    });
    let status = child.wait();
    handle.close();
    let _ = forwarder.join();
    Ok(Outcome::Exited(status?))
}
