//! The broker's side of the operator controls (`herdless ctl`) and of
//! admission by load and memory. The pool decides who may take a token
//! (`pool/controls.rs`); this module samples the machine, tells the pool,
//! answers control requests, and retires classic tokens after a shrink.
//!
//! # No timer in the hand-off path
//!
//! The machine is sampled when the loop wakes for an event anyway (a
//! request, a release, a returned classic token), at most once per
//! [`SAMPLE_EVERY`]. Only while admission is held *and* a token is free
//! for someone who waits does the loop sleep with a timeout, one re-check
//! per [`RECHECK`]: the load average itself moves only every few seconds
//! (Linux recomputes it every 5 s). Without limits, or with admission
//! open, the loop sleeps with no timeout as before.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::Broker;
use crate::log;
use crate::log::Level;
use crate::pool::ClientId;
use crate::protocol::ControlOp;
use crate::status::{CapStatus, ControlsStatus};

/// The environment variable that names a file to read the load average
/// and available memory from instead of the kernel: lines `load 3.5` and
/// `memory 1048576` (bytes). For tests, which must not load the machine to
/// cross a limit.
pub const SYSTEM_HOOK_ENV: &str = "HERDLESS_TEST_SYSTEM";

/// The most often the machine is sampled on events.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// How long the loop sleeps, at most, while admission alone holds a free
/// token back from a waiter.
pub const RECHECK: Duration = Duration::from_secs(1);

/// The most ancestors followed up from a client (a guard against a cycle
/// of stale process ids).
const MAX_ANCESTORS: usize = 64;

/// Limits on granting shared tokens by the machine's state (make's `-l`,
/// and the same for memory).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Admission {
    /// Grant no shared token while the 1-minute load average is above this.
    pub max_load: Option<f64>,
    /// Grant no shared token while less memory than this (bytes) is
    /// available.
    pub min_free_memory: Option<u64>,
    /// Jobs that may always run, whatever the limits say, counted as `-j`
    /// counts them (the implicit token of the command at the top is one):
    /// `min_jobs - 1` shared tokens are never held back.
    pub min_jobs: u32,
}

impl Admission {
    /// Whether any limit is set.
    pub fn limits(&self) -> bool {
        self.max_load.is_some() || self.min_free_memory.is_some()
    }
}

/// What the broker keeps for the controls.
pub(super) struct State {
    limits: Admission,
    hook: Option<PathBuf>,
    load: Option<f64>,
    free_memory: Option<u64>,
    sampled_at: Option<Instant>,
    /// Why admission is held, while it is.
    held: Option<String>,
    held_back: u64,
    /// Set by the first cap: from then on every client's ancestry is
    /// looked up (in `/proc`), which costs a few reads per connection.
    track_ancestry: bool,
}

impl State {
    pub(super) fn new(limits: &Admission) -> State {
        State {
            limits: limits.clone(),
            hook: std::env::var_os(SYSTEM_HOOK_ENV).map(PathBuf::from),
            load: None,
            free_memory: None,
            sampled_at: None,
            held: None,
            held_back: 0,
            track_ancestry: false,
        }
    }

    fn sample(&mut self) {
        let (load, memory) = match &self.hook {
            Some(path) => {
                let text = std::fs::read_to_string(path).unwrap_or_default();
                let field = |key: &str| {
                    text.lines()
                        .filter_map(|l| l.trim().strip_prefix(key))
                        .filter_map(|v| v.trim().parse::<f64>().ok())
                        .next_back()
                };
                (field("load "), field("memory ").map(|m| m as u64))
            }
            None => (
                self.limits.max_load.and(herdless_platform::load_average()),
                self.limits
                    .min_free_memory
                    .and(herdless_platform::available_memory()),
            ),
        };
        self.load = load;
        self.free_memory = memory;
        self.sampled_at = Some(Instant::now());
    }

    /// Why grants must be held back now, if they must.
    fn reason(&self) -> Option<String> {
        if let (Some(max), Some(load)) = (self.limits.max_load, self.load) {
            if load > max {
                return Some(format!("load {load:.2} above {max}"));
            }
        }
        if let (Some(min), Some(free)) = (self.limits.min_free_memory, self.free_memory) {
            if free < min {
                return Some(format!("{free} bytes of memory available, below {min}"));
            }
        }
        None
    }
}

impl Broker {
    /// Samples the machine (when a limit is set and the last sample is
    /// older than [`SAMPLE_EVERY`], or `force`) and opens or holds
    /// admission accordingly.
    pub(super) fn check_admission(&mut self, force: bool) {
        if !self.controls.limits.limits() {
            return;
        }
        let due = self
            .controls
            .sampled_at
            .map_or(true, |at| at.elapsed() >= SAMPLE_EVERY);
        if !(force || due) {
            return;
        }
        self.controls.sample();
        let reason = self.controls.reason();
        match (&self.controls.held, &reason) {
            (None, Some(why)) => {
                log!(Level::Info, "holding grants back: {why}");
                self.controls.held_back += 1;
            }
            (Some(_), None) => log!(Level::Info, "admission open again"),
            _ => {}
        }
        self.controls.held = reason;
        let floor = self.controls.limits.min_jobs.saturating_sub(1);
        let now = self.now();
        self.pool
            .set_admission(self.controls.held.is_none(), floor, now);
        self.apply_effects();
    }

    /// The loop's poll timeout: [`RECHECK`] while admission alone keeps a
    /// free token from a waiter (a native one in the queue, or, with a
    /// classic bridge, a classic reader the broker cannot see), else none.
    pub(super) fn admission_timeout(&self) -> Option<Duration> {
        let held = !self.pool.admission_open() && self.pool.free() > 0;
        (held && (self.pool.held_by_admission() || self.bridge.is_some())).then_some(RECHECK)
    }

    /// Carries out a control request from `id`.
    pub(super) fn control(&mut self, id: ClientId, op: ControlOp) -> Result<(), String> {
        let now = self.now();
        match op {
            ControlOp::SetJobs(jobs) => {
                super::check_jobs(jobs).map_err(|e| e.to_string())?;
                log!(
                    Level::Info,
                    "client {id} set -j {jobs} (was {})",
                    self.config.jobs
                );
                self.config.jobs = jobs;
                match self.backing.as_mut() {
                    // Borrowed on demand: the limit changes, a pool above
                    // it shrinks (its tokens go back to the outer
                    // jobserver as they come back), and a grow cancels a
                    // pending shrink first; what more the new limit allows
                    // is borrowed by the next step, as waiters need it.
                    Some(backing) => backing.resize(&mut self.pool, jobs, now),
                    None => self.pool.resize(jobs - 1, now),
                }
            }
            ControlOp::Cap { pid, max } => {
                if pid == 0 {
                    return Err("cannot cap pid 0".into());
                }
                self.track_ancestry();
                match max {
                    Some(max) => log!(Level::Info, "client {id} capped pid {pid} at {max}"),
                    None => log!(Level::Info, "client {id} lifted the cap on pid {pid}"),
                }
                self.pool.set_cap(pid, max, now);
            }
        }
        self.apply_effects();
        self.retire_from_pipe();
        Ok(())
    }

    /// Tells the pool a new client's ancestry, once caps are in use.
    pub(super) fn note_ancestry(&mut self, id: ClientId, pid: u32, ppid: u32) {
        if self.controls.track_ancestry {
            self.pool.set_ancestry(id, ancestors(pid, ppid));
        }
    }

    fn track_ancestry(&mut self) {
        if self.controls.track_ancestry {
            return;
        }
        self.controls.track_ancestry = true;
        let known: Vec<(ClientId, u32, u32)> = self
            .conns
            .values()
            .filter_map(|c| Some((c.client?, c.pid.unwrap_or(0), 0)))
            .collect();
        for (id, pid, ppid) in known {
            self.pool.set_ancestry(id, ancestors(pid, ppid));
        }
    }

    /// After a shrink, reads tokens left unread in the classic pipe back
    /// out, so they retire instead of running more classic jobs.
    pub(super) fn retire_from_pipe(&mut self) {
        if self.pool.retiring() == 0 {
            return;
        }
        let now = self.now();
        if let Some(bridge) = self.bridge.as_mut() {
            while self.pool.retiring() > 0 && bridge.reclaim_one(&mut self.pool, now) {}
        }
        self.apply_effects();
    }

    pub(super) fn controls_status(&self) -> ControlsStatus {
        let c = &self.controls;
        ControlsStatus {
            admission: c.held.clone().unwrap_or_else(|| "open".into()),
            max_load: c.limits.max_load,
            load: c.load,
            min_free_memory: c.limits.min_free_memory,
            free_memory: c.free_memory,
            min_jobs: c.limits.min_jobs,
            held_back: c.held_back,
            retiring: self.pool.retiring(),
            caps: self
                .pool
                .caps()
                .into_iter()
                .map(|cap| CapStatus {
                    pid: cap.pid,
                    max: cap.max,
                    held: cap.held,
                })
                .collect(),
        }
    }
}

/// A client's ancestors, parent first, as far as the OS tells (on Linux
/// up to init). `ppid` is used when the OS cannot tell a parent (0: none
/// known; protocol 3 clients do not name their parent).
fn ancestors(pid: u32, ppid: u32) -> Vec<u32> {
    let mut chain = Vec::new();
    let mut next = herdless_platform::parent_of(pid).unwrap_or(ppid);
    while next > 0 && chain.len() < MAX_ANCESTORS && !chain.contains(&next) && next != pid {
        chain.push(next);
        if next == 1 {
            break;
        }
        match herdless_platform::parent_of(next) {
            Some(p) => next = p,
            None => break,
        }
    }
    chain
}
