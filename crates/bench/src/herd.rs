//! One cell of the herd benchmark: W waiter processes, one mode, G grants.
//!
//! # How a run goes
//!
//! 1. The coordinator (this process) makes a private directory holding the
//!    shared thing the waiters wait on — a FIFO for the pipe modes, a
//!    mapped word for the futex mode, a broker's socket for herdless — and
//!    a FIFO for the waiters' records.
//! 2. It starts W waiters (the `herdless` binary as a hidden worker); each
//!    reports ready and waits. Once all are asleep the grant phase begins.
//! 3. Kernel modes: the coordinator is the releaser. It writes T tokens
//!    (one byte each, or one post of the word); each waiter that gets one
//!    reports it and goes back to waiting, and for each report the releaser
//!    writes the next token, until G tokens have been claimed.
//!
//!    Herdless: the coordinator holds the broker's T tokens and gives them
//!    back; each waiter that gets one notes it and gives it straight back,
//!    and the token goes to the next waiter in line (through the shared
//!    table, or the broker). The mechanism is the relay the releaser is in
//!    the kernel modes. The coordinator has no part in that relay, so a
//!    report per grant would only wake it in the middle of the next
//!    hand-off, a cost of the measurement alone: the waiters keep their
//!    notes (each grant with the give-back before it) until step 4. A
//!    budget of give-backs and keeps (see the `shared` module) ends the
//!    circulation after exactly G grants, and the waiter whose grant
//!    spends it sends the one record of the grant phase, `drained`.
//! 4. When every waiter sleeps again, the coordinator stops them all with
//!    one last wake-up each (it closes the FIFO, posts a stop, or passes
//!    one more token down the broker's line); each reports how often it
//!    woke and how much CPU it used (a herdless waiter, its kept notes
//!    first, written after its counters are read), and exits. On Linux the counters are
//!    read from `/proc` instead, from outside, while every waiter sleeps
//!    just before the first token and just after the last (see the
//!    `procs` and `waiter` modules).
//!
//! A release is the moment a token enters the mechanism (the write, the
//! post, the give-back to the broker); the hand-off ends when a waiter
//! holds it.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use herdless_platform::{self_rusage, SchedCount};
use serde::Serialize;

use super::channel::{Record, RecordReader};
use super::metrics::{handoffs, idle_while_free, quantile};
use super::procs::{counted, ensure_limits, wait_all_asleep, Workers};
use super::shared::{Scratch, Shared, RECORDS};
use super::{kernel_label, now_ns, BenchMode};
use herdless::client::Client;
use herdless::status::Status;

/// How long a run may go without any record from any waiter before it is
/// declared stuck. Not in any hand-off path: the coordinator waits for
/// records in `poll()` and returns as soon as one arrives.
const SILENCE_LIMIT: Duration = Duration::from_secs(120);
/// How often a silent coordinator checks that its waiters still live.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// One cell to measure.
#[derive(Debug, Clone)]
pub struct CellConfig {
    /// The `herdless` binary, run as each waiter.
    pub exe: PathBuf,
    /// How the waiters wait.
    pub mode: BenchMode,
    /// W: waiter processes.
    pub waiters: u32,
    /// G: tokens to hand out.
    pub grants: u64,
    /// T: tokens in circulation at once.
    pub tokens: u32,
    /// Kernel modes: before each release, wait until every waiter sleeps
    /// again, so that the kernel alone picks who wakes (no waiter still
    /// running from its last token can take the next one first). Slows
    /// the run down; for the order the kernel serves waiters in.
    pub settle: bool,
}

/// What one cell measured.
#[derive(Debug, Clone)]
pub struct CellResult {
    /// How the waiters waited.
    pub mode: BenchMode,
    /// W: waiter processes.
    pub waiters: u32,
    /// T: tokens in circulation at once.
    pub tokens: u32,
    /// Tokens claimed by waiters.
    pub grants: u64,
    /// Sleeps of all waiters ended during the grant phase.
    pub wakeups: u64,
    /// Sleeps ended in each waiter, by waiter index.
    pub wakeups_by_waiter: Vec<u64>,
    /// Grants each waiter got, by waiter index.
    pub grants_by_waiter: Vec<u64>,
    /// The waiter of each grant, in time order.
    pub winners: Vec<u32>,
    /// Each grant in time order: (waiter, when it began waiting, when it
    /// got the token), in ns of the machine's monotonic clock.
    pub grant_times: Vec<(u32, u64, u64)>,
    /// When each waiter began the wait the stop ended.
    pub open_waits: Vec<u64>,
    /// User + system time of the waiters during the grant phase.
    pub waiter_cpu: Duration,
    /// User + system time of the coordinator (releaser, broker) during
    /// the grant phase.
    pub releaser_cpu: Duration,
    /// Release → claim, sorted, in nanoseconds.
    pub handoffs_ns: Vec<u64>,
    /// First release to last claim.
    pub elapsed: Duration,
    /// Time a token was free while a waiter waited.
    pub idle_while_free: Duration,
    /// "Linux 6.18.44", from `uname()`.
    pub kernel: String,
}

impl CellResult {
    /// Sleeps ended per token claimed: 1.00 when exactly one process
    /// wakes per grant.
    pub fn wakeups_per_grant(&self) -> f64 {
        ratio(self.wakeups as f64, self.grants as f64)
    }

    /// CPU of the waiters and the releaser per grant, in microseconds.
    pub fn cpu_us_per_grant(&self) -> f64 {
        ratio(
            (self.waiter_cpu + self.releaser_cpu).as_secs_f64() * 1e6,
            self.grants as f64,
        )
    }

    /// Median time from a release to the waiter's return, in microseconds.
    pub fn handoff_p50_us(&self) -> f64 {
        quantile(&self.handoffs_ns, 0.5) as f64 / 1000.0
    }

    /// 99th percentile of the hand-off time, in microseconds.
    pub fn handoff_p99_us(&self) -> f64 {
        quantile(&self.handoffs_ns, 0.99) as f64 / 1000.0
    }

    /// The hand-off time at the 10th, 20th … 90th percentiles, in
    /// microseconds. On 2 vCPUs a hand-off takes a few microseconds when
    /// the heir wakes on the other processor and tens when it waits for
    /// the releaser's, in about equal shares, so the median alone can
    /// fall in either mode from one run to the next.
    pub fn handoff_deciles_us(&self) -> Vec<f64> {
        (1..10)
            .map(|i| quantile(&self.handoffs_ns, f64::from(i) / 10.0) as f64 / 1000.0)
            .collect()
    }

    /// Tokens claimed per second of the grant phase.
    pub fn grants_per_s(&self) -> f64 {
        ratio(self.grants as f64, self.elapsed.as_secs_f64())
    }

    /// Waiters that woke at least once.
    pub fn processes_woken(&self) -> usize {
        self.wakeups_by_waiter.iter().filter(|&&w| w > 0).count()
    }

    /// The row `bench herd --json` prints.
    pub fn row(&self) -> HerdRow {
        HerdRow {
            mode: self.mode.name().to_owned(),
            waiters: self.waiters,
            grants: self.grants,
            wakeups_per_grant: round(self.wakeups_per_grant(), 3),
            cpu_us_per_grant: round(self.cpu_us_per_grant(), 2),
            handoff_p50_us: round(self.handoff_p50_us(), 2),
            handoff_p99_us: round(self.handoff_p99_us(), 2),
            handoff_deciles_us: self
                .handoff_deciles_us()
                .into_iter()
                .map(|d| round(d, 2))
                .collect(),
            grants_per_s: round(self.grants_per_s(), 1),
            idle_while_free_us: round(self.idle_while_free.as_secs_f64() * 1e6, 1),
            kernel: self.kernel.clone(),
        }
    }
}

/// One line of `herdless bench herd --json`: exactly these keys.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct HerdRow {
    /// The wait mode's name.
    pub mode: String,
    /// W: waiter processes.
    pub waiters: u32,
    /// Tokens claimed.
    pub grants: u64,
    /// See [`CellResult::wakeups_per_grant`].
    pub wakeups_per_grant: f64,
    /// See [`CellResult::cpu_us_per_grant`].
    pub cpu_us_per_grant: f64,
    /// See [`CellResult::handoff_p50_us`].
    pub handoff_p50_us: f64,
    /// See [`CellResult::handoff_p99_us`].
    pub handoff_p99_us: f64,
    /// See [`CellResult::handoff_deciles_us`].
    pub handoff_deciles_us: Vec<f64>,
    /// See [`CellResult::grants_per_s`].
    pub grants_per_s: f64,
    /// Total over the run, in µs.
    pub idle_while_free_us: f64,
    /// The kernel measured.
    pub kernel: String,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// The standard matrix's numbers of waiters.
pub const STANDARD_WAITERS: [u32; 5] = [1, 8, 64, 256, 1024];

/// Runs every (mode, W) cell in turn, modes outermost, drawing a progress
/// bar on stderr when it is a terminal. Modes the OS lacks are left out,
/// each with a note on stderr.
///
/// # Errors
///
/// The first cell that fails, named.
pub fn run_matrix(
    exe: &Path,
    modes: &[BenchMode],
    waiters: &[u32],
    grants: u64,
    tokens: u32,
) -> io::Result<Vec<CellResult>> {
    let mut usable = Vec::new();
    for &m in modes {
        match m.available() {
            Ok(()) if !usable.contains(&m) => usable.push(m),
            Ok(()) => {}
            Err(why) => eprintln!("herdless: skipping {m}: {why}"),
        }
    }
    let mut bar = super::progress::Progress::new(usable.len() * waiters.len());
    let mut cells = Vec::new();
    for &mode in &usable {
        for &w in waiters {
            let cfg = CellConfig {
                exe: exe.to_path_buf(),
                mode,
                waiters: w,
                grants,
                tokens,
                settle: false,
            };
            bar.update(&format!("{mode} W={w}: starting"));
            let cell = run_cell(&cfg, &mut |n| {
                bar.update(&format!("{mode} W={w}: {n}/{grants} grants"))
            })
            .map_err(|e| io::Error::new(e.kind(), format!("{mode} with {w} waiters: {e}")))?;
            bar.step();
            cells.push(cell);
        }
    }
    bar.finish();
    Ok(cells)
}

/// Runs one cell. `progress` is called with the number of grants claimed so
/// far, now and then.
///
/// # Errors
///
/// `Unsupported` for a mode this OS lacks; `InvalidInput` for zero
/// waiters, grants or tokens; a limit too low for W processes; any failure
/// of a waiter (with its message) or of the set-up.
pub fn run_cell(cfg: &CellConfig, progress: &mut dyn FnMut(u64)) -> io::Result<CellResult> {
    check_cell(cfg)?;
    let mut scratch = Scratch::new()?;
    let dir = scratch.dir().to_path_buf();
    let mut records = RecordReader::open(&scratch.fifo(RECORDS)?)?;
    let mut shared = Shared::create(cfg.mode, cfg.grants, cfg.tokens, &mut scratch)?;

    let mut run = Run {
        cfg,
        records: &mut records,
        workers: Workers::new("waiter"),
        pids: vec![0; cfg.waiters as usize],
        t_want: vec![0; cfg.waiters as usize],
        finals: vec![None; cfg.waiters as usize],
        got: Vec::new(),
        releases: Vec::new(),
        last_record: Instant::now(),
    };
    run.start_waiters(&dir)?;
    if let Some(socket) = shared.socket() {
        run.wait_for_queue(socket)?;
    }
    wait_all_asleep(&run.pids, Duration::from_secs(60))?;
    let counted0 = counted(&run.pids);

    // The releaser's CPU is this whole process's in every mode: in the
    // kernel modes it reads the records and releases; in herdless mode it
    // runs the broker's thread and waits for the one `drained` record.
    let usage0 = self_rusage()?;
    let t0 = now_ns();
    run.grant_phase(&mut shared, progress)?;
    let usage1 = self_rusage()?;

    // Let the last herd settle, then stop everyone.
    wait_all_asleep(&run.pids, Duration::from_secs(60))?;
    let counted1 = counted(&run.pids);
    let t_stop = now_ns();
    run.stop_phase(&mut shared)?;
    progress(run.got.len() as u64);

    let releaser_cpu = usage1.since(&usage0).cpu();
    let waiters = waiter_counts(counted0, counted1, &run.finals);
    Ok(run.figures(t0, t_stop, releaser_cpu, waiters))
}

/// Refuses a cell this OS cannot run, or one with nothing to measure, and
/// checks the process and descriptor limits it needs.
fn check_cell(cfg: &CellConfig) -> io::Result<()> {
    cfg.mode.available().map_err(|why| {
        io::Error::new(io::ErrorKind::Unsupported, format!("{}: {why}", cfg.mode))
    })?;
    if cfg.waiters == 0 || cfg.grants == 0 || cfg.tokens == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "waiters, grants and tokens must all be at least 1",
        ));
    }
    let fds = if matches!(cfg.mode, BenchMode::Herdless | BenchMode::HerdlessSocket) {
        u64::from(cfg.waiters)
    } else {
        0
    };
    ensure_limits(u64::from(cfg.waiters), fds)
}

/// Each waiter's wake-ups during the grant phase, and the waiters' CPU in
/// all (ns). Where the scheduler's own counts can be read from outside
/// (Linux) they bracket the grant phase exactly; elsewhere each waiter's
/// getrusage() does, with the first wait's entry and the stop's wake-up in
/// its CPU time (see the waiter module).
fn waiter_counts(
    before: Option<Vec<SchedCount>>,
    after: Option<Vec<SchedCount>>,
    finals: &[Option<(u64, u64)>],
) -> (Vec<u64>, u64) {
    match (before, after) {
        (Some(a), Some(b)) => (
            a.iter()
                .zip(&b)
                .map(|(a, b)| b.sleeps.saturating_sub(a.sleeps))
                .collect(),
            a.iter()
                .zip(&b)
                .map(|(a, b)| b.cpu_ns.saturating_sub(a.cpu_ns))
                .sum(),
        ),
        _ => {
            let finals: Vec<(u64, u64)> = finals.iter().map(|f| f.unwrap_or((0, 0))).collect();
            (
                finals.iter().map(|f| f.0).collect(),
                finals.iter().map(|f| f.1).sum(),
            )
        }
    }
}

/// Waits until every waiter is back asleep: exactly on Linux, by a short
/// pause elsewhere (ample for a waiter that has just reported its token).
fn settle(pids: &[u32]) -> io::Result<()> {
    if cfg!(target_os = "linux") {
        wait_all_asleep(pids, Duration::from_secs(60))
    } else {
        thread::sleep(Duration::from_millis(2));
        Ok(())
    }
}

/// The coordinator's view of one run in progress.
struct Run<'a> {
    cfg: &'a CellConfig,
    records: &'a mut RecordReader,
    workers: Workers,
    pids: Vec<u32>,
    /// Each waiter's latest wait start.
    t_want: Vec<u64>,
    /// (wakes, cpu ns) from each waiter's final record.
    finals: Vec<Option<(u64, u64)>>,
    /// (waiter, t_want, t_got) of each claim.
    got: Vec<(u32, u64, u64)>,
    releases: Vec<u64>,
    last_record: Instant,
}

impl Run<'_> {
    /// Hands out the cell's grants and collects what the waiters report.
    fn grant_phase(
        &mut self,
        shared: &mut Shared,
        progress: &mut dyn FnMut(u64),
    ) -> io::Result<()> {
        let cfg = self.cfg;
        shared.start(cfg.tokens, &mut self.releases)?;
        if shared.socket().is_some() {
            // Herdless waiters keep their reports until the stop.
            return match self.next_record()? {
                Record::Drained { .. } => Ok(()),
                other => self.unexpected(other),
            };
        }
        let mut last_progress = Instant::now();
        while (self.got.len() as u64) < cfg.grants {
            match self.next_record()? {
                Record::Got {
                    idx,
                    t_want,
                    t_got,
                    t_rel,
                } => {
                    self.got.push((idx, t_want, t_got));
                    self.t_want[idx as usize] = t_want;
                    self.releases.extend(t_rel);
                    if cfg.settle && shared.socket().is_none() {
                        settle(&self.pids)?;
                    }
                    shared.after_grant(&mut self.releases)?;
                }
                other => self.unexpected(other)?,
            }
            if last_progress.elapsed() > Duration::from_millis(100) {
                progress(self.got.len() as u64);
                last_progress = Instant::now();
            }
        }
        Ok(())
    }

    /// Stops every waiter, collects their final reports and reaps them.
    fn stop_phase(&mut self, shared: &mut Shared) -> io::Result<()> {
        shared.stop(self.cfg.waiters)?;
        let kept_back = shared.socket().is_some();
        while self.finals.iter().any(Option::is_none) {
            match self.next_record()? {
                Record::Got {
                    idx,
                    t_want,
                    t_got,
                    t_rel,
                } if kept_back && self.finals.get(idx as usize).is_some_and(Option::is_none) => {
                    self.got.push((idx, t_want, t_got));
                    self.releases.extend(t_rel);
                }
                Record::Final {
                    idx,
                    wakes,
                    cpu_ns,
                    t_want,
                    t_rel,
                } => {
                    self.finals[idx as usize] = Some((wakes, cpu_ns));
                    self.t_want[idx as usize] = t_want;
                    self.releases.extend(t_rel);
                }
                other => self.unexpected(other)?,
            }
        }
        self.workers.reap(Duration::from_secs(30))?;
        if self.got.len() as u64 != self.cfg.grants {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} grants reported, {} handed out",
                    self.got.len(),
                    self.cfg.grants
                ),
            ));
        }
        shared.finish()
    }

    /// The cell's figures, from the grants recorded, the grant phase's
    /// start `t0`, the stop at `t_stop`, and the CPU and wake-ups counted.
    fn figures(
        &self,
        t0: u64,
        t_stop: u64,
        releaser_cpu: Duration,
        (wakeups_by_waiter, waiter_cpu_ns): (Vec<u64>, u64),
    ) -> CellResult {
        let cfg = self.cfg;
        let t_end = self.got.iter().map(|g| g.2).max().unwrap_or(t0);
        let mut grants_by_waiter = vec![0u64; cfg.waiters as usize];
        let mut got = self.got.clone();
        got.sort_by_key(|g| g.2);
        for g in &got {
            grants_by_waiter[g.0 as usize] += 1;
        }
        let claims: Vec<u64> = got.iter().map(|g| g.2).collect();
        let mut waits: Vec<(u64, u64)> = got.iter().map(|g| (g.1, g.2)).collect();
        // Each waiter's last wait, ended by the stop.
        waits.extend(self.t_want.iter().map(|&t| (t, t_stop)));
        CellResult {
            mode: cfg.mode,
            waiters: cfg.waiters,
            tokens: cfg.tokens,
            grants: got.len() as u64,
            wakeups: wakeups_by_waiter.iter().sum(),
            wakeups_by_waiter,
            grants_by_waiter,
            winners: got.iter().map(|g| g.0).collect(),
            grant_times: got.clone(),
            open_waits: self.t_want.clone(),
            waiter_cpu: Duration::from_nanos(waiter_cpu_ns),
            releaser_cpu,
            handoffs_ns: handoffs(&self.releases, &claims),
            elapsed: Duration::from_nanos(t_end.saturating_sub(t0)),
            idle_while_free: Duration::from_nanos(idle_while_free(
                &self.releases,
                &claims,
                &waits,
                t0,
                t_end,
            )),
            kernel: kernel_label(),
        }
    }

    fn start_waiters(&mut self, dir: &Path) -> io::Result<()> {
        let mut ready = 0u32;
        for i in 0..self.cfg.waiters {
            let mut cmd = Command::new(&self.cfg.exe);
            cmd.args(worker_args(self.cfg.mode, i, dir))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            self.workers.spawn(cmd)?;
            // Take what has come so far, so that no waiter blocks on a
            // full FIFO while the others start.
            while let Some(r) = self.records.try_next()? {
                ready += self.on_ready(r)?;
            }
        }
        self.last_record = Instant::now();
        while ready < self.cfg.waiters {
            let r = self.next_record()?;
            ready += self.on_ready(r)?;
        }
        Ok(())
    }

    fn on_ready(&mut self, record: Record) -> io::Result<u32> {
        match record {
            Record::Ready { idx, pid } => {
                let slot = self.pids.get_mut(idx as usize).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, format!("no waiter {idx}"))
                })?;
                *slot = pid;
                self.t_want[idx as usize] = now_ns();
                Ok(1)
            }
            other => self.unexpected(other).map(|()| 0),
        }
    }

    /// Herdless: every waiter's request is queued at the broker.
    fn wait_for_queue(&mut self, observer: &Path) -> io::Result<()> {
        let start = Instant::now();
        loop {
            let json = Client::observe(observer)
                .and_then(|s| s.json())
                .map_err(io::Error::other)?;
            let status: Status = serde_json::from_str(&json).map_err(io::Error::other)?;
            if status.waiting == self.cfg.waiters {
                return Ok(());
            }
            self.workers.check_alive()?;
            if start.elapsed() > Duration::from_secs(60) {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "only {} of {} waiters queued at the broker after 60 s",
                        status.waiting, self.cfg.waiters
                    ),
                ));
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// The next record; an error if a waiter died or all fell silent.
    fn next_record(&mut self) -> io::Result<Record> {
        loop {
            if let Some(r) = self.records.next(LIVENESS_CHECK)? {
                self.last_record = Instant::now();
                if let Record::Failed { message, .. } = &r {
                    return Err(io::Error::other(message.clone()));
                }
                return Ok(r);
            }
            self.workers.check_alive()?;
            if self.last_record.elapsed() > SILENCE_LIMIT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no word from any of the {} {} waiters for {} s",
                        self.cfg.waiters,
                        self.cfg.mode,
                        SILENCE_LIMIT.as_secs()
                    ),
                ));
            }
        }
    }

    fn unexpected(&self, record: Record) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "unexpected record from a {} waiter: {record:?}",
                self.cfg.mode
            ),
        ))
    }
}

/// The command line of waiter `idx`.
fn worker_args(mode: BenchMode, idx: u32, dir: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "bench",
        "worker",
        "waiter",
        "--mode",
        mode.name(),
        "--index",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push(idx.to_string().into());
    args.push("--dir".into());
    args.push(dir.as_os_str().to_owned());
    args
}
