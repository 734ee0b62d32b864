//! The relay: one token passed round a ring of processes, each waking the
//! next one directly with one of the kernel's own wake-one primitives.
//!
//! This is the hand-off herdless's shared table makes (the giver wakes the
//! heir, then sleeps), with nothing of herdless in it: no table, no
//! tickets, no broker. Each process has a wake-up channel of its own:
//!
//! - `futex`: a word in a mapped file of its own (a wake-one futex,
//!   `_umtx_op` or NetBSD's futex: [`SharedWord`]);
//! - `pipe`: a FIFO of its own, which it reads with a blocking read; the
//!   giver writes one byte into it. Linux wakes a pipe's reader with its
//!   *sync* hint (the writer is about to sleep), a futex's without.
//!
//! A hop is the time from the giver's clock reading, just before its wake
//! call, to the heir's, just after its wait returns. Where the heir runs
//! decides most of it: on the giver's processor once the giver sleeps, or
//! on another one, whose wake-up is the kernel's (and on a virtual machine
//! the hypervisor's) to make. The relay shows how the hops of the kernel's
//! primitives divide between the two, with the same processes and the same
//! order as a herdless hand-off.
//!
//! # How a run goes
//!
//! The coordinator makes a private directory with each process's channel
//! and a count of the hops left, starts the W processes (the `herdless`
//! binary as a hidden worker, `herdless bench worker relay …`), waits until
//! all of them sleep and wakes process 0. A process that wakes takes a hop
//! from the count (its number is what was left), notes the time, notes the
//! time again and wakes the next process in the ring, and waits again.
//! When the count is spent, the process that finds it so wakes the next
//! one and ends; so does each after it. Each process then writes what it
//! noted into a file of its own, which the coordinator reads after every
//! process has ended. The first lap, W hops (processes cold, the FIFOs of
//! the next ones opened on first use), is left out of the figures.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use herdless_platform::{SharedCount, SharedWord};
use serde::{Deserialize, Serialize};

use super::channel::{open_fifo_read, open_fifo_write};
use super::metrics::quantile;
use super::procs::{die_with_parent, ensure_limits, wait_all_asleep, Workers};
use super::shared::Scratch;
use super::{now_ns, WorkerArgs};

/// Processes in the ring.
pub const RELAY_PROCESSES: u32 = 64;
/// Hops measured, after the first lap.
pub const RELAY_HOPS: u32 = 4000;

/// The count of hops left.
const HOPS: &str = "hops";
/// The count of processes that have not opened their channels yet.
const UNREADY: &str = "unready";
/// How long the processes may take to fall asleep, or to finish.
const LIMIT: Duration = Duration::from_secs(60);

/// How a process wakes the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A word of its own in a mapped file, woken by a wake-one futex.
    Futex,
    /// A FIFO of its own, read with a blocking read; woken by one byte.
    Pipe,
}

impl Wake {
    /// Both, in the order the probe shows them.
    pub const ALL: [Wake; 2] = [Wake::Futex, Wake::Pipe];

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Wake::Futex => "futex",
            Wake::Pipe => "pipe",
        }
    }

    /// Whether this OS has it.
    ///
    /// # Errors
    ///
    /// Why not.
    pub fn available(self) -> Result<(), String> {
        match self {
            Wake::Futex => herdless_platform::wait::Mode::Futex
                .available()
                .map_err(|e| e.reason().to_owned()),
            Wake::Pipe => Ok(()),
        }
    }

    fn parse(s: &str) -> Option<Wake> {
        Wake::ALL.into_iter().find(|w| w.name() == s)
    }

    fn channel(self, dir: &Path, i: u32) -> PathBuf {
        dir.join(format!("relay-{}-{i}", self.name()))
    }
}

/// One primitive's relay, as `herdless probe --json` gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelayResult {
    /// The primitive's name.
    pub wake: String,
    /// Whether this OS has it.
    pub available: bool,
    /// Why not, when not available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Processes in the ring.
    pub processes: u32,
    /// Hops measured (the first lap left out).
    pub hops: u32,
    /// Hop p10, p20 … p90, in microseconds.
    pub deciles_us: Vec<f64>,
    /// Hop p99, in microseconds.
    pub p99_us: f64,
}

impl RelayResult {
    /// The median hop, in microseconds.
    pub fn p50_us(&self) -> Option<f64> {
        self.deciles_us.get(4).copied()
    }

    fn unavailable(wake: Wake, reason: String) -> RelayResult {
        RelayResult {
            wake: wake.name().to_owned(),
            available: false,
            reason: Some(reason),
            processes: 0,
            hops: 0,
            deciles_us: Vec::new(),
            p99_us: 0.0,
        }
    }
}

/// Runs one relay of `processes` processes and `hops` measured hops.
///
/// # Errors
///
/// A process that could not start, failed, or did not finish in time.
pub fn run_relay(exe: &Path, wake: Wake, processes: u32, hops: u32) -> io::Result<RelayResult> {
    if let Err(reason) = wake.available() {
        return Ok(RelayResult::unavailable(wake, reason));
    }
    if processes < 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a relay needs at least 2 processes",
        ));
    }
    ensure_limits(u64::from(processes), 3 * u64::from(processes))?;
    let total = hops
        .checked_add(processes)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "too many hops for a relay"))?;
    let mut scratch = Scratch::new()?;
    let dir = scratch.dir().to_owned();
    let _count = SharedCount::create(scratch.track(HOPS), total)?;
    let unready = SharedCount::create(scratch.track(UNREADY), processes)?;
    for i in 0..processes {
        match wake {
            Wake::Futex => drop(SharedWord::create(
                scratch.track(&format!("relay-futex-{i}")),
            )?),
            Wake::Pipe => {
                scratch.fifo(&format!("relay-pipe-{i}"))?;
            }
        }
        scratch.track(&format!("relay-out-{i}"));
    }

    let mut workers = Workers::new("relay process");
    for i in 0..processes {
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "worker", "relay", "--wake", wake.name()])
            .arg("--index")
            .arg(i.to_string())
            .arg("--processes")
            .arg(processes.to_string())
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        workers.spawn(cmd)?;
    }
    let start = std::time::Instant::now();
    while unready.value() > 0 {
        workers.check_alive()?;
        if start.elapsed() > LIMIT {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} relay processes not ready", unready.value()),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    wait_all_asleep(&workers.pids(), LIMIT)?;
    workers.check_alive()?;
    wake_next(wake, &dir, 0)?;
    workers.reap(LIMIT)?;

    // Each hop's release (the giver's time before its wake call) and claim
    // (the heir's after its wait), by hop number: hop h is claimed by the
    // process that took h from the count; its giver released hop h − 1.
    let n = total as usize;
    let mut claims = vec![None; n];
    let mut releases = vec![None; n];
    for i in 0..processes {
        let file = File::open(dir.join(format!("relay-out-{i}")))?;
        for line in BufReader::new(file).lines() {
            let line = line?;
            let mut f = line.split_ascii_whitespace().map(str::parse::<u64>);
            match (f.next(), f.next(), f.next()) {
                (Some(Ok(h)), Some(Ok(got)), Some(Ok(rel))) if (h as usize) < n => {
                    claims[h as usize] = Some(got);
                    releases[h as usize] = Some(rel);
                }
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("relay process {i} wrote {line:?}"),
                    ))
                }
            }
        }
    }
    let mut lat = hop_times(&claims, &releases, processes as usize)?;
    lat.sort_unstable();
    let us = |ns: u64| (ns as f64 / 100.0).round() / 10.0;
    Ok(RelayResult {
        wake: wake.name().to_owned(),
        available: true,
        reason: None,
        processes,
        hops: u32::try_from(lat.len()).unwrap_or(u32::MAX),
        deciles_us: (1..10)
            .map(|d| us(quantile(&lat, f64::from(d) / 10.0)))
            .collect(),
        p99_us: us(quantile(&lat, 0.99)),
    })
}

/// The hop times, from the first after the first lap: the claim of hop h
/// less the release of hop h − 1. Every hop must have both.
fn hop_times(claims: &[Option<u64>], releases: &[Option<u64>], lap: usize) -> io::Result<Vec<u64>> {
    let missing = |h: usize| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the relay lost hop {h}: no process noted it"),
        )
    };
    (lap.max(1)..claims.len())
        .map(|h| {
            let got = claims[h].ok_or_else(|| missing(h))?;
            let rel = releases[h - 1].ok_or_else(|| missing(h - 1))?;
            Ok(got.saturating_sub(rel))
        })
        .collect()
}

/// Wakes process `i`'s channel once.
fn wake_next(wake: Wake, dir: &Path, i: u32) -> io::Result<()> {
    match wake {
        Wake::Futex => SharedWord::open(wake.channel(dir, i))?.post(),
        Wake::Pipe => open_fifo_write(&wake.channel(dir, i), false)?.write_all(&[1]),
    }
}

/// The waiting end of a process's own channel, and the waking end of the
/// next process's (opened on first use: the next process has its FIFO
/// open by then, as every process does before it first sleeps).
enum Ends {
    Futex {
        mine: SharedWord,
        next: SharedWord,
    },
    Pipe {
        mine: File,
        // Kept open so that a read never sees end of file.
        _writer: File,
        next: Option<File>,
        next_path: PathBuf,
    },
}

impl Ends {
    fn open(wake: Wake, dir: &Path, i: u32, next: u32) -> io::Result<Ends> {
        Ok(match wake {
            Wake::Futex => Ends::Futex {
                mine: SharedWord::open(wake.channel(dir, i))?,
                next: SharedWord::open(wake.channel(dir, next))?,
            },
            Wake::Pipe => {
                let path = wake.channel(dir, i);
                let mine = open_fifo_read(&path, false)?;
                Ends::Pipe {
                    _writer: open_fifo_write(&path, false)?,
                    mine,
                    next: None,
                    next_path: wake.channel(dir, next),
                }
            }
        })
    }

    fn wait(&mut self) -> io::Result<()> {
        match self {
            Ends::Futex { mine, .. } => mine.take(),
            Ends::Pipe { mine, .. } => {
                let mut b = [0u8; 1];
                loop {
                    match mine.read(&mut b) {
                        Ok(1) => return Ok(()),
                        Ok(_) => return Err(io::ErrorKind::UnexpectedEof.into()),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    fn wake_next(&mut self) -> io::Result<()> {
        match self {
            Ends::Futex { next, .. } => next.post(),
            Ends::Pipe {
                next, next_path, ..
            } => {
                if next.is_none() {
                    *next = Some(open_fifo_write(next_path, false)?);
                }
                next.as_mut().map_or(Ok(()), |f| f.write_all(&[1]))
            }
        }
    }
}

/// The body of `herdless bench worker relay`: one process of the ring.
pub(super) fn main(args: &WorkerArgs) -> io::Result<()> {
    let wake = args
        .os("wake")?
        .to_str()
        .and_then(Wake::parse)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad --wake"))?;
    let i: u32 = args.get("index")?;
    let processes: u32 = args.get("processes")?;
    let dir = Path::new(args.os("dir")?);
    die_with_parent();
    let count = SharedCount::open(dir.join(HOPS))?;
    let total = count.value();
    let mut ends = Ends::open(wake, dir, i, (i + 1) % processes)?;
    SharedCount::open(dir.join(UNREADY))?.take_one();
    let mut noted = Vec::new();
    loop {
        ends.wait()?;
        let got = now_ns();
        let Some(left) = count.take_one_left() else {
            // The end: pass it on, to a process that may have ended
            // already (its FIFO closed: nothing to wake).
            let _ = ends.wake_next();
            break;
        };
        let rel = now_ns();
        ends.wake_next()?;
        noted.push((total - 1 - left, got, rel));
    }
    let mut out = String::new();
    for (h, got, rel) in noted {
        out.push_str(&format!("{h} {got} {rel}\n"));
    }
    fs::write(dir.join(format!("relay-out-{i}")), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hop_is_its_claim_less_the_release_before_it() {
        let claims = [Some(10), Some(25), Some(40), Some(70)];
        let releases = [Some(12), Some(30), Some(45), Some(71)];
        // Lap 2: hops 2 and 3 count.
        assert_eq!(hop_times(&claims, &releases, 2).unwrap(), vec![10, 25]);
        // Lap 0 still leaves out hop 0, which the coordinator started.
        assert_eq!(hop_times(&claims, &releases, 0).unwrap(), vec![13, 10, 25]);
    }

    #[test]
    fn a_hop_nobody_noted_is_an_error() {
        let claims = [Some(1), None, Some(3)];
        let releases = [Some(1), Some(2), Some(3)];
        let e = hop_times(&claims, &releases, 1).unwrap_err();
        assert!(e.to_string().contains("hop 1"), "{e}");
        let releases = [Some(1), None, Some(3)];
        let claims = [Some(1), Some(2), Some(3)];
        assert!(hop_times(&claims, &releases, 1).is_err());
    }
}
