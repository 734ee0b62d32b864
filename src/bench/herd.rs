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
//!    back; each waiter that gets one gives it straight back to the broker,
//!    which hands it to the next waiter in line. The broker is the relay
//!    the releaser is in the kernel modes. Once G grants are reported, a
//!    stop file tells waiters to keep the next token they get, and the
//!    circulation ends when all T are kept (a few grants past G, all
//!    counted).
//! 4. When every waiter sleeps again, the coordinator stops them all (it
//!    closes the FIFO, posts a stop, or stops the broker); each reports how
//!    often it woke and how much CPU it used, and exits.
//!
//! A release is the moment a token enters the mechanism (the write, the
//! post, the give-back to the broker); the hand-off ends when a waiter
//! holds it.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use herdless_platform::wait::Mode;
use herdless_platform::{self_rusage, SharedWord};
use serde::Serialize;

use super::channel::{make_fifo, open_fifo_read, open_fifo_write, Record, RecordReader};
use super::metrics::{handoffs, idle_while_free, quantile};
use super::procs::{
    cpu_ns_of, current_tid, ensure_limits, thread_cpu_ns, wait_all_asleep, Workers,
};
use super::{kernel_label, now_ns, BenchMode};
use crate::broker::{Broker, Config, Status};
use crate::client::{Client, Options};
use crate::rundir::RunDir;

/// The FIFO the pipe modes wait on.
pub(crate) const TOKENS: &str = "tokens";
/// The FIFO waiters report on.
pub(crate) const RECORDS: &str = "records";
/// The futex mode's token word.
pub(crate) const WORD: &str = "word";
/// The futex mode's stop flag.
pub(crate) const STOP_WORD: &str = "stop-word";
/// Herdless mode: once it exists, waiters keep the tokens they get.
pub(crate) const STOP_FILE: &str = "stop";

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
    pub mode: BenchMode,
    /// W: waiter processes.
    pub waiters: u32,
    /// G: tokens to hand out (herdless may hand out a few more, see the
    /// module documentation; all are counted).
    pub grants: u64,
    /// T: tokens in circulation at once.
    pub tokens: u32,
}

/// What one cell measured.
#[derive(Debug, Clone)]
pub struct CellResult {
    pub mode: BenchMode,
    pub waiters: u32,
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
    pub fn wakeups_per_grant(&self) -> f64 {
        ratio(self.wakeups as f64, self.grants as f64)
    }

    pub fn cpu_us_per_grant(&self) -> f64 {
        ratio(
            (self.waiter_cpu + self.releaser_cpu).as_secs_f64() * 1e6,
            self.grants as f64,
        )
    }

    pub fn handoff_p50_us(&self) -> f64 {
        quantile(&self.handoffs_ns, 0.5) as f64 / 1000.0
    }

    pub fn handoff_p99_us(&self) -> f64 {
        quantile(&self.handoffs_ns, 0.99) as f64 / 1000.0
    }

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
            grants_per_s: round(self.grants_per_s(), 1),
            idle_while_free_us: round(self.idle_while_free.as_secs_f64() * 1e6, 1),
            kernel: self.kernel.clone(),
        }
    }
}

/// One line of `herdless bench herd --json`: exactly these keys.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct HerdRow {
    pub mode: String,
    pub waiters: u32,
    pub grants: u64,
    pub wakeups_per_grant: f64,
    pub cpu_us_per_grant: f64,
    pub handoff_p50_us: f64,
    pub handoff_p99_us: f64,
    pub grants_per_s: f64,
    /// Total over the run, in µs.
    pub idle_while_free_us: f64,
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

/// Runs one cell. `progress` is called with the number of grants claimed so
/// far, now and then.
///
/// # Errors
///
/// `Unsupported` for a mode this OS lacks; `InvalidInput` for zero
/// waiters, grants or tokens; a limit too low for W processes; any failure
/// of a waiter (with its message) or of the set-up.
pub fn run_cell(cfg: &CellConfig, progress: &mut dyn FnMut(u64)) -> io::Result<CellResult> {
    cfg.mode.available().map_err(|why| {
        io::Error::new(io::ErrorKind::Unsupported, format!("{}: {why}", cfg.mode))
    })?;
    if cfg.waiters == 0 || cfg.grants == 0 || cfg.tokens == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "waiters, grants and tokens must all be at least 1",
        ));
    }
    let fds = if cfg.mode == BenchMode::Herdless {
        u64::from(cfg.waiters)
    } else {
        0
    };
    ensure_limits(u64::from(cfg.waiters), fds)?;
    let scratch = Scratch::new()?;
    let dir = scratch.dir.dir().to_path_buf();
    make_fifo(&scratch.track(RECORDS))?;
    let mut records = RecordReader::open(&dir.join(RECORDS))?;
    let mut shared = Shared::create(cfg, &scratch)?;

    let mut run = Run {
        cfg,
        records: &mut records,
        workers: Workers::new("waiter"),
        pids: vec![0; cfg.waiters as usize],
        t_want: vec![0; cfg.waiters as usize],
        finals: vec![None; cfg.waiters as usize],
        got: Vec::new(),
        releases: Vec::new(),
        parked: 0,
        last_record: Instant::now(),
    };
    run.start_waiters(&dir)?;
    if let Shared::Herdless { observer, .. } = &shared {
        run.wait_for_queue(observer)?;
    }
    wait_all_asleep(&run.pids, Duration::from_secs(60))?;
    let cpu0 = cpu_ns_of(&run.pids);

    // The grant phase.
    let relay0 = shared.relay_cpu_ns();
    let usage0 = self_rusage()?;
    let t0 = now_ns();
    // Herdless circulates all T tokens; the releaser writes at most G.
    let first = match shared {
        Shared::Herdless { .. } => u64::from(cfg.tokens),
        _ => u64::from(cfg.tokens).min(cfg.grants),
    };
    let mut released = 0u64;
    while released < first {
        run.releases.push(now_ns());
        shared.release()?;
        released += 1;
    }
    let mut stop_file_made = false;
    let mut last_progress = Instant::now();
    loop {
        let record = run.next_record()?;
        if let Record::Got {
            idx,
            t_want,
            t_got,
            t_rel,
            parked,
        } = record
        {
            run.on_got(idx, t_want, t_got, t_rel, parked);
            let claimed = run.got.len() as u64;
            match &mut shared {
                Shared::Herdless { .. } => {
                    if claimed >= cfg.grants && !stop_file_made {
                        fs::File::create(scratch.track(STOP_FILE))?;
                        stop_file_made = true;
                    }
                    if run.parked == cfg.tokens {
                        break;
                    }
                }
                _ => {
                    if released < cfg.grants {
                        run.releases.push(now_ns());
                        shared.release()?;
                        released += 1;
                    }
                    if claimed == cfg.grants {
                        break;
                    }
                }
            }
            if last_progress.elapsed() > Duration::from_millis(100) {
                progress(claimed);
                last_progress = Instant::now();
            }
        } else {
            run.unexpected(record)?;
        }
    }
    let usage1 = self_rusage()?;
    let relay1 = shared.relay_cpu_ns();

    // Let the last herd settle, then stop everyone.
    wait_all_asleep(&run.pids, Duration::from_secs(60))?;
    let cpu1 = cpu_ns_of(&run.pids);
    let t_stop = now_ns();
    shared.stop(cfg.waiters)?;
    while run.finals.iter().any(Option::is_none) {
        let record = run.next_record()?;
        match record {
            Record::Final {
                idx,
                wakes,
                cpu_ns,
                t_want,
            } => {
                run.finals[idx as usize] = Some((wakes, cpu_ns));
                run.t_want[idx as usize] = t_want;
            }
            // Herdless: a waiter that gave its token back just before the
            // stop file appeared may report after the token was kept.
            Record::Got {
                idx,
                t_want,
                t_got,
                t_rel,
                parked,
            } => run.on_got(idx, t_want, t_got, t_rel, parked),
            other => run.unexpected(other)?,
        }
    }
    run.workers.reap(Duration::from_secs(30))?;
    let t_end = run.got.iter().map(|g| g.2).max().unwrap_or(t0);
    progress(run.got.len() as u64);

    // The figures.
    let n = cfg.waiters as usize;
    let mut grants_by_waiter = vec![0u64; n];
    let mut got = run.got.clone();
    got.sort_by_key(|g| g.2);
    for g in &got {
        grants_by_waiter[g.0 as usize] += 1;
    }
    let claims: Vec<u64> = got.iter().map(|g| g.2).collect();
    let mut waits: Vec<(u64, u64)> = got.iter().map(|g| (g.1, g.2)).collect();
    // Each waiter's last wait, ended by the stop.
    waits.extend(run.t_want.iter().map(|&t| (t, t_stop)));
    let finals: Vec<(u64, u64)> = run.finals.iter().map(|f| f.unwrap_or((0, 0))).collect();
    // Read from outside where possible: the waiters' own figures also hold
    // their first wait's entry and the stop's wake-up.
    let waiter_cpu_ns: u64 = match (cpu0, cpu1) {
        (Some(a), Some(b)) => a.iter().zip(&b).map(|(a, b)| b.saturating_sub(*a)).sum(),
        _ => finals.iter().map(|f| f.1).sum(),
    };
    Ok(CellResult {
        mode: cfg.mode,
        waiters: cfg.waiters,
        tokens: cfg.tokens,
        grants: got.len() as u64,
        wakeups: finals.iter().map(|f| f.0).sum(),
        wakeups_by_waiter: finals.iter().map(|f| f.0).collect(),
        grants_by_waiter,
        winners: got.iter().map(|g| g.0).collect(),
        waiter_cpu: Duration::from_nanos(waiter_cpu_ns),
        releaser_cpu: match (relay0, relay1) {
            (Some(a), Some(b)) => Duration::from_nanos(b.saturating_sub(a)),
            _ => usage1.since(&usage0).cpu(),
        },
        handoffs_ns: handoffs(&run.releases, &claims),
        elapsed: Duration::from_nanos(t_end.saturating_sub(t0)),
        idle_while_free: Duration::from_nanos(idle_while_free(
            &run.releases,
            &claims,
            &waits,
            t0,
            t_end,
        )),
        kernel: kernel_label(),
    })
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
    parked: u32,
    last_record: Instant,
}

impl Run<'_> {
    fn on_got(&mut self, idx: u32, t_want: u64, t_got: u64, t_rel: Option<u64>, parked: bool) {
        self.got.push((idx, t_want, t_got));
        self.t_want[idx as usize] = t_want;
        self.releases.extend(t_rel);
        self.parked += u32::from(parked);
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

/// The run's private directory; removes what it made when dropped.
struct Scratch {
    dir: RunDir,
    files: std::cell::RefCell<Vec<PathBuf>>,
}

impl Scratch {
    fn new() -> io::Result<Scratch> {
        Ok(Scratch {
            dir: RunDir::create()?,
            files: std::cell::RefCell::new(Vec::new()),
        })
    }

    /// The path of `name` in the directory, to be removed at the end.
    fn track(&self, name: &str) -> PathBuf {
        let p = self.dir.dir().join(name);
        self.files.borrow_mut().push(p.clone());
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for f in self.files.borrow().iter() {
            let _ = fs::remove_file(f);
        }
    }
}

/// What the waiters of one mode share.
enum Shared {
    Pipe {
        writer: Option<fs::File>,
        /// Keeps the FIFO open for reading so that the write end can be
        /// opened before any waiter has.
        _reader: fs::File,
    },
    Futex {
        word: SharedWord,
        stop: SharedWord,
    },
    Herdless {
        observer: PathBuf,
        /// The releaser's connection, holding the tokens not yet released.
        _releaser: Client,
        held: Vec<crate::Token>,
        stopper: crate::broker::Stopper,
        thread: Option<thread::JoinHandle<io::Result<Status>>>,
        /// The broker thread, whose CPU time is the relay's (Linux).
        tid: Option<i32>,
    },
}

impl Shared {
    fn create(cfg: &CellConfig, scratch: &Scratch) -> io::Result<Shared> {
        match cfg.mode {
            BenchMode::Kernel(Mode::Futex) => Ok(Shared::Futex {
                word: SharedWord::create(scratch.track(WORD))?,
                stop: SharedWord::create(scratch.track(STOP_WORD))?,
            }),
            BenchMode::Kernel(_) => {
                let path = scratch.track(TOKENS);
                make_fifo(&path)?;
                let reader = open_fifo_read(&path, true)?;
                let writer = open_fifo_write(&path, true)?;
                Ok(Shared::Pipe {
                    writer: Some(writer),
                    _reader: reader,
                })
            }
            BenchMode::Herdless => {
                let socket = scratch.dir.socket().to_path_buf();
                let broker = Broker::bind(&socket, Config::new(cfg.tokens + 1))?;
                let stopper = broker.stopper();
                let (tid_tx, tid_rx) = std::sync::mpsc::channel();
                let thread = thread::Builder::new()
                    .name("herdless-broker".into())
                    .spawn(move || {
                        let _ = tid_tx.send(current_tid());
                        broker.run()
                    })?;
                let tid = tid_rx.recv().ok().flatten();
                let releaser =
                    Client::connect_with(&socket, Options::default().implicit_token(false))
                        .map_err(io::Error::other)?;
                let held = (0..cfg.tokens)
                    .map(|_| releaser.acquire())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(io::Error::other)?;
                Ok(Shared::Herdless {
                    observer: socket,
                    _releaser: releaser,
                    held,
                    stopper,
                    thread: Some(thread),
                    tid,
                })
            }
        }
    }

    /// CPU time of the relay between waiters — the broker's thread —
    /// where it can be told apart from the rest of this process, whose
    /// other thread only reads the waiters' records. `None` means: count
    /// the whole process (the kernel modes' releaser is this process).
    fn relay_cpu_ns(&self) -> Option<u64> {
        match self {
            Shared::Herdless { tid: Some(tid), .. } => thread_cpu_ns(*tid),
            _ => None,
        }
    }

    /// Puts one token into circulation.
    fn release(&mut self) -> io::Result<()> {
        match self {
            Shared::Pipe { writer, .. } => {
                let w = writer.as_mut().expect("the FIFO is open until stop");
                w.write_all(b"+")
            }
            Shared::Futex { word, .. } => word.post(),
            Shared::Herdless { held, .. } => {
                let token = held.pop().expect("no more releases than tokens held");
                token.release().map_err(io::Error::other)
            }
        }
    }

    /// Wakes every waiter for the last time.
    fn stop(&mut self, waiters: u32) -> io::Result<()> {
        match self {
            Shared::Pipe { writer, .. } => {
                drop(writer.take());
                Ok(())
            }
            Shared::Futex { word, stop } => {
                stop.post()?;
                for _ in 0..waiters {
                    word.post()?;
                }
                Ok(())
            }
            Shared::Herdless {
                stopper, thread, ..
            } => {
                stopper.stop();
                let status = thread
                    .take()
                    .expect("stopped once")
                    .join()
                    .map_err(|_| io::Error::other("the broker thread panicked"))??;
                if status.lost != 0 {
                    return Err(io::Error::other(format!(
                        "the broker lost {} token(s)",
                        status.lost
                    )));
                }
                Ok(())
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Shared::Herdless {
            stopper, thread, ..
        } = self
        {
            if let Some(t) = thread.take() {
                stopper.stop();
                let _ = t.join();
            }
        }
    }
}
