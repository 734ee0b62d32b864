//! The build model: the recursive make of the seed report, on a classic
//! token pipe with each combination of P, C and R, and on the broker.
//!
//! A top make runs M sub-makes as its jobs; each sub-make runs K jobs of
//! X µs of CPU work. Every make may run up to N jobs at once (`-j N`) and
//! takes tokens from one pool of N − 1: a FIFO holding N − 1 bytes for the
//! classic variants (each make opens it, as GNU make 4.4 does), or a broker
//! for `-j N`. See the `make` module for what P, C and R change.
//!
//! The top make holds a token for every sub-make it runs, and a sub-make
//! runs its first job in that token — the implicit token. Without the
//! implicit-token check (C) a sub-make with nothing running must first see
//! a free token, so once the top holds all of them every sub-make waits
//! for a token nobody will release: the stall the report shows as "did not
//! finish". A run that passes the cut-off is stopped (its process group
//! killed) and reported as stalled.

use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use herdless_platform::{children_rusage, self_rusage};
use serde::Serialize;

use super::channel::{make_fifo, open_fifo_read, open_fifo_write};
use super::kernel_label;
pub use super::make::Variant;
use super::make::{make_args, spin};
use super::procs::ensure_limits;
use super::shared::TOKENS;
use herdless::broker::{Broker, Config};
use herdless::rundir::RunDir;

/// One build-model run's parameters.
#[derive(Debug, Clone)]
pub struct BuildConfig {
    /// The `herdless` binary, run as each make.
    pub exe: PathBuf,
    /// M: sub-makes.
    pub makes: u32,
    /// K: jobs per sub-make.
    pub jobs_per_make: u32,
    /// X: CPU time of one job, in µs (on an idle core).
    pub job_us: u64,
    /// N: `-j`.
    pub jobs: u32,
    /// A run still going after this is stopped and reported as stalled.
    pub stall_after: Duration,
}

/// What one variant measured.
#[derive(Debug, Clone)]
pub struct BuildResult {
    /// What ran.
    pub variant: Variant,
    /// With which tree.
    pub config: BuildConfig,
    /// Start of the top make to its end, or to the cut-off.
    pub wall: Duration,
    /// CPU and context switches of every make and of this process (the
    /// broker's thread); unknown for a stalled run, whose processes were
    /// killed before they could be counted.
    pub user: Option<Duration>,
    /// System CPU, counted like `user`.
    pub system: Option<Duration>,
    /// Voluntary context switches, counted like `user`.
    pub voluntary_ctx: Option<u64>,
    /// Involuntary context switches, counted like `user`.
    pub involuntary_ctx: Option<u64>,
    /// The run passed the cut-off and was stopped.
    pub stalled: bool,
    /// Tokens in the pool once the run ended (N − 1 when none was lost;
    /// a stalled classic run loses those its killed makes held).
    pub tokens_back: u32,
    /// The kernel measured (`uname -sr`).
    pub kernel: String,
}

impl BuildResult {
    /// The row `bench build --json` prints.
    pub fn row(&self) -> BuildRow {
        let secs = |d: Option<Duration>| d.map(|d| (d.as_secs_f64() * 1000.0).round() / 1000.0);
        BuildRow {
            variant: self.variant.name(),
            makes: self.config.makes,
            jobs_per_make: self.config.jobs_per_make,
            job_us: self.config.job_us,
            jobs: self.config.jobs,
            wall_s: (self.wall.as_secs_f64() * 1000.0).round() / 1000.0,
            user_s: secs(self.user),
            system_s: secs(self.system),
            voluntary_ctx_switches: self.voluntary_ctx,
            involuntary_ctx_switches: self.involuntary_ctx,
            stalled: self.stalled,
            tokens_back: self.tokens_back,
            kernel: self.kernel.clone(),
        }
    }
}

/// One line of `herdless bench build --json`.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct BuildRow {
    /// `P1C1R0`-style name of the pipe variant, or `herdless`.
    pub variant: String,
    /// Makes in the tree.
    pub makes: u32,
    /// Jobs each make runs.
    pub jobs_per_make: u32,
    /// CPU each job burns, in microseconds.
    pub job_us: u64,
    /// The `-j` of the tree.
    pub jobs: u32,
    /// Wall time, in seconds.
    pub wall_s: f64,
    /// User CPU of the whole tree, in seconds (none for a stalled run).
    pub user_s: Option<f64>,
    /// System CPU of the whole tree, in seconds (none for a stalled run).
    pub system_s: Option<f64>,
    /// Voluntary context switches of the whole tree.
    pub voluntary_ctx_switches: Option<u64>,
    /// Involuntary context switches of the whole tree.
    pub involuntary_ctx_switches: Option<u64>,
    /// The run passed the cut-off.
    pub stalled: bool,
    /// Tokens in the pool at the end (N − 1 when none was lost).
    pub tokens_back: u32,
    /// The kernel measured.
    pub kernel: String,
}

/// Loop iterations of `spin` per µs on one core of this machine: the
/// best of three timings, so that a busy moment makes jobs longer, never
/// shorter.
pub fn calibrate() -> f64 {
    let mut n = 50_000u64;
    let probe = loop {
        let t = Instant::now();
        spin(n);
        let e = t.elapsed();
        if e >= Duration::from_millis(10) || n >= 1 << 40 {
            break e;
        }
        n *= 2;
    };
    let mut best = probe;
    for _ in 0..3 {
        let t = Instant::now();
        spin(n);
        best = best.min(t.elapsed());
    }
    n as f64 / (best.as_secs_f64() * 1e6).max(1e-3)
}

/// Runs one variant. `iters_per_us` comes from [`calibrate`].
///
/// # Errors
///
/// `InvalidInput` for zero makes, jobs or `-j`; a make that fails (rather
/// than stalls); any failure to set the run up.
pub fn run_variant(
    cfg: &BuildConfig,
    variant: Variant,
    iters_per_us: f64,
) -> io::Result<BuildResult> {
    if cfg.makes == 0 || cfg.jobs_per_make == 0 || cfg.jobs == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "--makes, --jobs-per-make and -j must all be at least 1",
        ));
    }
    ensure_limits(u64::from(cfg.makes) + 1, u64::from(cfg.makes) + 8)?;
    let mut dir = RunDir::create()?;
    let spin_iters = (cfg.job_us as f64 * iters_per_us).round() as u64;
    let capacity = cfg.jobs - 1;

    // The pool.
    let fifo_path = dir.dir().join(TOKENS);
    let mut fifo = None;
    let mut broker = None;
    match variant {
        Variant::Pipe { .. } => {
            make_fifo(&fifo_path)?;
            let reader = open_fifo_read(&fifo_path, true)?;
            let mut writer = open_fifo_write(&fifo_path, true)?;
            writer.write_all(&vec![b'+'; capacity as usize])?;
            fifo = Some((reader, writer));
        }
        Variant::Herdless => {
            let b = Broker::bind(dir.socket(), Config::new(cfg.jobs))?;
            dir.set_bound();
            let stopper = b.stopper();
            let t = thread::Builder::new()
                .name("herdless-broker".into())
                .spawn(move || b.run())?;
            broker = Some((stopper, t));
        }
    }

    let mut cmd = Command::new(&cfg.exe);
    cmd.args(make_args(
        "top",
        cfg.makes,
        cfg.jobs_per_make,
        cfg.jobs,
        spin_iters,
        variant,
        dir.dir(),
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    // Its own process group, so that a stalled tree can be killed whole.
    .process_group(0);

    let children0 = children_rusage()?;
    let self0 = self_rusage()?;
    let start = Instant::now();
    let mut top = cmd.spawn()?;
    let pid = top.id();
    let (tx, rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let _ = tx.send(top.wait());
    });
    let (stalled, status) = match rx.recv_timeout(cfg.stall_after) {
        Ok(status) => (false, Some(status?)),
        Err(_) => {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = rx.recv();
            (true, None)
        }
    };
    let wall = start.elapsed();
    let _ = waiter.join();
    let children1 = children_rusage()?;
    let self1 = self_rusage()?;
    if let Some(status) = status {
        if !status.success() {
            return Err(io::Error::other(format!(
                "{variant}: the top make failed ({status})"
            )));
        }
    }

    let tokens_back = if let Some((mut reader, _writer)) = fifo {
        let mut back = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => back.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        let _ = std::fs::remove_file(&fifo_path);
        back.len() as u32
    } else if let Some((stopper, t)) = broker {
        stopper.stop();
        let status = t
            .join()
            .map_err(|_| io::Error::other("the broker thread panicked"))??;
        status.free
    } else {
        0
    };

    let counted = !stalled;
    let c = children1.since(&children0);
    let s = self1.since(&self0);
    Ok(BuildResult {
        variant,
        config: cfg.clone(),
        wall,
        user: counted.then(|| c.user + s.user),
        system: counted.then(|| c.system + s.system),
        voluntary_ctx: counted.then(|| c.voluntary_ctx + s.voluntary_ctx),
        involuntary_ctx: counted.then(|| c.involuntary_ctx + s.involuntary_ctx),
        stalled,
        tokens_back,
        kernel: kernel_label(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_and_print() {
        let all = Variant::all();
        assert_eq!(all.len(), 9);
        assert_eq!(all[0].name(), "P0C0R0");
        assert_eq!(all[6].name(), "P1C1R0");
        for v in all {
            assert_eq!(v.name().parse::<Variant>(), Ok(v));
        }
        assert_eq!("p1c1r1".parse::<Variant>().unwrap().name(), "P1C1R1");
        assert!("P2C0R0".parse::<Variant>().is_err());
        assert!("poll".parse::<Variant>().unwrap_err().contains("herdless"));
    }

    #[test]
    fn calibration_is_positive() {
        assert!(calibrate() > 1.0);
    }
}
