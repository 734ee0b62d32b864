//! Thundering-herd measurements: how many processes each way of waiting for
//! a job token wakes, what that costs, and how a recursive build fares.
//!
//! - [`herd`] runs W waiter processes that wait for tokens in one
//!   [`BenchMode`] while a releaser hands out G tokens, and measures
//!   wake-ups, CPU, hand-off latency, throughput and idle-while-free time
//!   for each grant (`herdless bench herd`).
//! - [`build`] models the recursive make of the seed report: makes that take
//!   job tokens from a classic pipe with or without polling it (P), the
//!   implicit-token check (C) and a sleep after a failed read (R), or from
//!   the broker (`herdless bench build`).
//! - [`probe`] tells what this kernel does: processes woken by one write and
//!   the order waiters are served in (`herdless probe`).
//!
//! Every waiter and every make is a real process: the `herdless` binary run
//! again as a hidden worker (`herdless bench worker …`, see [`worker_main`]),
//! so the kernel sees what it would see in a build. Wake-ups are counted as
//! context switches, never as returns from a wait call (which hide the
//! herd). Nothing here asserts a timing; the figures are reports.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod build;
mod channel;
pub mod herd;
mod make;
mod metrics;
pub mod plot;
pub mod probe;
mod procs;
pub mod progress;
pub mod realmake;
pub mod relay;
pub mod report;
mod shared;
mod waiter;

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::str::FromStr;

use herdless_platform::wait::Mode;

pub use herd::{run_cell, CellConfig, CellResult};

/// A way for waiters to wait for a token: one of the kernel's
/// ([`Mode`]), or the herdless broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BenchMode {
    /// Waiters share a pipe (a FIFO each opens) and wait in this mode; the
    /// futex mode shares a word in a mapped file instead.
    Kernel(Mode),
    /// Waiters are native clients of a broker, with its shared token
    /// table where the OS has one (the fast path).
    Herdless,
    /// Waiters are native clients of a broker that offers no shared table:
    /// every grant is one frame the broker writes to one of them.
    HerdlessSocket,
}

impl BenchMode {
    /// Every mode, the kernel's in [`Mode::ALL`] order, then herdless.
    pub fn all() -> Vec<BenchMode> {
        Mode::ALL
            .into_iter()
            .map(BenchMode::Kernel)
            .chain([BenchMode::Herdless, BenchMode::HerdlessSocket])
            .collect()
    }

    /// Every mode this OS offers, in [`BenchMode::all`] order.
    pub fn available_modes() -> Vec<BenchMode> {
        BenchMode::all()
            .into_iter()
            .filter(|m| m.available().is_ok())
            .collect()
    }

    /// The mode's name: a [`Mode`] name, "herdless" or "herdless-socket".
    pub fn name(self) -> &'static str {
        match self {
            BenchMode::Kernel(m) => m.name(),
            BenchMode::Herdless => "herdless",
            BenchMode::HerdlessSocket => "herdless-socket",
        }
    }

    /// Whether this OS offers the mode.
    ///
    /// # Errors
    ///
    /// The reason, for a kernel mode the OS lacks (see [`Mode::available`]).
    pub fn available(self) -> Result<(), String> {
        match self {
            BenchMode::Kernel(m) => m.available().map_err(|e| e.reason().to_owned()),
            BenchMode::Herdless | BenchMode::HerdlessSocket => Ok(()),
        }
    }
}

impl fmt::Display for BenchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BenchMode {
    type Err = String;

    fn from_str(s: &str) -> Result<BenchMode, String> {
        match s {
            "herdless" => return Ok(BenchMode::Herdless),
            "herdless-socket" => return Ok(BenchMode::HerdlessSocket),
            _ => {}
        }
        s.parse::<Mode>()
            .map(BenchMode::Kernel)
            .map_err(|e| format!("{e}, herdless, herdless-socket"))
    }
}

/// The body of the hidden `herdless bench worker ROLE ARGS…` command: a
/// herd waiter (`waiter`), a make of the build model (`make`) or a process
/// of the probe's relay (`relay`). The
/// arguments are written by this module's coordinators and are not a
/// user interface.
///
/// # Errors
///
/// An `InvalidInput` error for arguments this module did not write; any
/// error of the worker, which it has also reported to its coordinator where
/// it could.
pub fn worker_main(args: Vec<OsString>) -> io::Result<()> {
    let mut args = args.into_iter();
    let role = args.next().and_then(|r| r.into_string().ok());
    let rest = WorkerArgs::parse(args)?;
    match role.as_deref() {
        Some("waiter") => waiter::main(&rest),
        Some("make") => make::main(&rest),
        Some("relay") => relay::main(&rest),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unknown bench worker role {other:?}"),
        )),
    }
}

/// `--key value` pairs of a worker's command line.
#[derive(Debug, Default)]
struct WorkerArgs {
    pairs: Vec<(String, OsString)>,
}

impl WorkerArgs {
    fn parse(mut args: impl Iterator<Item = OsString>) -> io::Result<WorkerArgs> {
        let mut pairs = Vec::new();
        while let Some(key) = args.next() {
            let key = key
                .into_string()
                .ok()
                .and_then(|k| k.strip_prefix("--").map(str::to_owned))
                .ok_or_else(|| bad_arg("expected --KEY VALUE"))?;
            let value = args
                .next()
                .ok_or_else(|| bad_arg(&format!("--{key} needs a value")))?;
            pairs.push((key, value));
        }
        Ok(WorkerArgs { pairs })
    }

    fn os(&self, key: &str) -> io::Result<&OsString> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| bad_arg(&format!("missing --{key}")))
    }

    fn get<T: FromStr>(&self, key: &str) -> io::Result<T> {
        self.os(key)?
            .to_str()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad_arg(&format!("bad value for --{key}")))
    }
}

fn bad_arg(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("bench worker: {what}"))
}

/// "Linux 6.18.44": the kernel's name and release, as reports print it.
pub fn kernel_label() -> String {
    let k = herdless_platform::kernel();
    format!("{} {}", k.sysname, k.release)
}

/// Nanoseconds on the machine-wide monotonic clock (see
/// [`herdless_platform::monotonic`]).
fn now_ns() -> u64 {
    u64::try_from(herdless_platform::monotonic().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print() {
        for m in BenchMode::all() {
            assert_eq!(m.name().parse::<BenchMode>(), Ok(m));
        }
        let err = "pol".parse::<BenchMode>().unwrap_err();
        assert!(err.contains("herdless") && err.contains("epoll"), "{err}");
        assert!(BenchMode::available_modes().contains(&BenchMode::Herdless));
    }

    #[test]
    fn worker_args() {
        let args = ["--mode", "poll", "--index", "7"].map(OsString::from);
        let w = WorkerArgs::parse(args.into_iter()).unwrap();
        assert_eq!(w.get::<u32>("index").unwrap(), 7);
        assert_eq!(
            w.get::<BenchMode>("mode").unwrap(),
            BenchMode::Kernel(Mode::Poll)
        );
        assert!(w.get::<u32>("dir").is_err());
        let odd = ["mode", "poll"].map(OsString::from);
        assert!(WorkerArgs::parse(odd.into_iter()).is_err());
        let short = ["--mode"].map(OsString::from);
        assert!(WorkerArgs::parse(short.into_iter()).is_err());
    }
}
