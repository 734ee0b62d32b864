//! What this kernel does when processes wait on one thing: the measurements
//! behind ARCHITECTURE §2, repeated on the machine at hand.
//!
//! For each mode the OS offers:
//! - how many of 32 waiting processes one token wakes (processes whose
//!   sleep one write ended, counted from context switches);
//! - in what order 8 waiters are served over 200 grants, one token at a
//!   time, each written once all waiters sleep again: the one waiting
//!   longest (FIFO), the one that began waiting last (LIFO), or neither,
//!   with the count each got.
//!
//! - how long a hand-off takes when each of 64 processes in a ring wakes
//!   the next one directly with a futex or a pipe of its own, as a giver
//!   hands a token to its heir in herdless's table ([`relay`](super::relay)).
//!
//! The pause before each write shows the kernel's own choice among
//! sleepers. Without it (as in `bench herd`), a waiter still running from
//! its last token can take the next byte before the sleeper the kernel
//! woke gets to run, so even the FIFO modes serve in a mixed order.

use std::fmt::Write as _;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::herd::{run_cell, CellConfig};
use super::metrics::{classify, Order};
use super::relay::{run_relay, RelayResult, Wake, RELAY_HOPS, RELAY_PROCESSES};
use super::BenchMode;

/// Waiters in the wake-up count.
pub const WOKEN_OF: u32 = 32;
/// Waiters in the order test.
pub const ORDER_WAITERS: u32 = 8;
/// Grants in the order test.
pub const ORDER_GRANTS: u64 = 200;

/// `herdless probe --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// `uname` sysname, e.g. "Linux".
    pub os: String,
    /// `uname` release.
    pub release: String,
    /// The primitives found.
    pub capabilities: Capabilities,
    /// Each wait mode's behaviour.
    pub modes: Vec<ProbeMode>,
    /// The relay, for each of the kernel's primitives.
    #[serde(default)]
    pub relay: Vec<RelayResult>,
}

/// The wake-up primitives the kernel offers (see
/// [`herdless_platform::Capabilities`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// `EPOLLEXCLUSIVE` (Linux 4.5 and later).
    pub epoll_exclusive: bool,
    /// A blocking pipe read wakes one sleeper (Linux 5.6 and later).
    pub exclusive_pipe_read: bool,
    /// A wake-one futex (or `_umtx_op`, NetBSD's futex).
    pub futex: bool,
    /// kqueue.
    pub kqueue: bool,
    /// Which way native clients of a broker on this host take tokens:
    /// `"shared table"` (a sealed memfd and a shared futex: the fast
    /// path), or `"socket"` with the reason the table is not available.
    #[serde(default)]
    pub token_path: String,
}

/// One mode's line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeMode {
    /// The mode's name.
    pub mode: String,
    /// Whether this kernel has it.
    pub available: bool,
    /// Why not, when not available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Of [`WOKEN_OF`] waiting processes, how many one token woke.
    pub woken: Option<u32>,
    /// "FIFO", "LIFO" or "mixed", over [`ORDER_GRANTS`] grants to
    /// [`ORDER_WAITERS`] waiters.
    pub order: Option<String>,
    /// Grants each of the [`ORDER_WAITERS`] waiters got.
    pub served: Option<Vec<u64>>,
}

/// Probes every mode, herdless last, then runs the relay with each
/// primitive. `progress` hears which mode or relay is being probed.
///
/// # Errors
///
/// Any failure of a run (a mode the OS lacks is reported, not an error).
pub fn probe(exe: PathBuf, progress: &mut dyn FnMut(&str)) -> io::Result<ProbeReport> {
    let caps = herdless_platform::capabilities();
    let mut modes = Vec::new();
    for mode in BenchMode::all() {
        if let Err(reason) = mode.available() {
            modes.push(ProbeMode {
                mode: mode.name().to_owned(),
                available: false,
                reason: Some(reason),
                woken: None,
                order: None,
                served: None,
            });
            continue;
        }
        progress(mode.name());
        let one = run_cell(
            &CellConfig {
                exe: exe.clone(),
                mode,
                waiters: WOKEN_OF,
                grants: 1,
                tokens: 1,
                settle: false,
            },
            &mut |_| {},
        )?;
        let order = run_cell(
            &CellConfig {
                exe: exe.clone(),
                mode,
                waiters: ORDER_WAITERS,
                grants: ORDER_GRANTS,
                tokens: 1,
                settle: true,
            },
            &mut |_| {},
        )?;
        let class = classify(&order.grant_times, &order.open_waits);
        modes.push(ProbeMode {
            mode: mode.name().to_owned(),
            available: true,
            reason: None,
            woken: Some(one.processes_woken() as u32),
            order: Some(class.name().to_owned()),
            served: Some(match class {
                Order::Mixed(counts) => counts,
                _ => order.grants_by_waiter.clone(),
            }),
        });
    }
    let mut relay = Vec::new();
    for wake in Wake::ALL {
        progress(&format!("{} relay", wake.name()));
        relay.push(run_relay(&exe, wake, RELAY_PROCESSES, RELAY_HOPS)?);
    }
    Ok(ProbeReport {
        os: caps.kernel.sysname.clone(),
        release: caps.kernel.release.clone(),
        capabilities: Capabilities {
            epoll_exclusive: caps.epoll_exclusive,
            exclusive_pipe_read: caps.exclusive_pipe_read,
            futex: caps.futex,
            kqueue: caps.kqueue,
            token_path: match herdless_platform::segment_support() {
                Ok(()) if herdless::broker::fast_path_wanted() => {
                    match herdless::fast::handoff_support() {
                        Ok(()) => "shared table, waits in it handed off".to_owned(),
                        Err(why) => format!("shared table, waits at the broker ({why})"),
                    }
                }
                Ok(()) => format!("socket ({}=0)", herdless::broker::FAST_PATH_ENV),
                Err(why) => format!("socket ({why})"),
            },
        },
        modes,
        relay,
    })
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The report, for people.
pub fn table(r: &ProbeReport) -> String {
    let mut out = String::new();
    let c = &r.capabilities;
    let _ = writeln!(out, "kernel        {} {}", r.os, r.release);
    let _ = writeln!(
        out,
        "capabilities  EPOLLEXCLUSIVE {}, exclusive pipe reads {}, shared futex {}, kqueue {}",
        yes(c.epoll_exclusive),
        yes(c.exclusive_pipe_read),
        yes(c.futex),
        yes(c.kqueue)
    );
    let _ = writeln!(out, "token path    {}", c.token_path);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<16} {:>13}   order of {ORDER_WAITERS} waiters over {ORDER_GRANTS} grants",
        "mode",
        format!("woken of {WOKEN_OF}")
    );
    for m in r.modes.iter().filter(|m| m.available) {
        let served = m
            .served
            .as_ref()
            .map(|s| s.iter().map(u64::to_string).collect::<Vec<_>>().join(" "))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<16} {:>13}   {:<6} ({served})",
            m.mode,
            m.woken.map_or("–".to_owned(), |w| w.to_string()),
            m.order.as_deref().unwrap_or("–"),
        );
    }
    for m in r.modes.iter().filter(|m| !m.available) {
        let _ = writeln!(
            out,
            "{:<16} unavailable: {}",
            m.mode,
            m.reason.as_deref().unwrap_or("")
        );
    }
    if let Some(first) = r.relay.iter().find(|x| x.available) {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "relay of {} processes, each waking the next, {} hops: hand-off in µs",
            first.processes, first.hops
        );
        let _ = writeln!(
            out,
            "{:<16} {}  {:>6}",
            "wake",
            (1..10)
                .map(|d| format!("{:>6}", format!("p{d}0")))
                .collect::<String>(),
            "p99"
        );
    }
    for x in &r.relay {
        if x.available {
            let deciles: String = x.deciles_us.iter().map(|v| format!("{v:>6.1}")).collect();
            let _ = writeln!(out, "{:<16} {deciles}  {:>6.1}", x.wake, x.p99_us);
        } else {
            let _ = writeln!(
                out,
                "{:<16} unavailable: {}",
                format!("{} relay", x.wake),
                x.reason.as_deref().unwrap_or("")
            );
        }
    }
    out
}
