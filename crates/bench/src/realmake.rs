//! The build model with real makes (`herdless bench make`): one recursive
//! tree run by each make variant in turn, in one run, so the figures can
//! be compared as ratios.
//!
//! The tree: a top Makefile of `subs` sub-makes (`$(MAKE)`), each running
//! `per` jobs that sleep `job_ms` milliseconds and record how many jobs
//! run at once (the `mkdir`/`rmdir` trick of the tests, which only ever
//! under-counts). The same Makefiles serve GNU make and bmake.
//!
//! What is measured, per variant:
//! - wall time of the whole tree;
//! - user + system CPU of the whole tree (`getrusage(RUSAGE_CHILDREN)`:
//!   every make, every job, and a broker thread inside a make or in
//!   `herdless run`);
//! - voluntary context switches of the makes and the broker only: a small
//!   preload library (compiled here with `cc`) appends, at each process's
//!   exit, the process's own `getrusage(RUSAGE_SELF)` when its command name
//!   contains `make` (`make`, `bmake`) or is `herdless` (a make's in-process broker thread
//!   is part of its process; `herdless run` is the broker of the bridge
//!   variant). Jobs (`sh`, `sleep`, `mkdir`) are left out: they are the
//!   same in every variant;
//! - the same per job (each job is one token's use);
//! - the most jobs running at once;
//! - **idle slots while jobs wait**: a thread of the benchmark counts the
//!   jobs running (the entries of `running/`) every 2 ms and the jobs
//!   started so far; from the first job's start until the last job's
//!   start (while some job of the tree has yet to start), each sample
//!   adds N − running slots for 2 ms. The sum, as a share of N × that
//!   span, is the part of the pool left unused while work waited: a make
//!   that notices a free token late (Debian's bmake, which does not poll
//!   its pipe) shows here first. The sampler is in the benchmark's own
//!   process, outside every figure above.
//!
//! With `mix` the jobs of each sub-make sleep `job_ms` times 1, 1, 1, 2,
//! 2, 4, 10, 20 in turn (5.1 × `job_ms` on average): long jobs beside short
//! ones, so that a make with only long jobs running has to notice tokens
//! that the others free.
//!
//! Nothing here asserts: these are reports.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

/// One way of running the tree.
#[derive(Clone, Debug)]
pub struct MakeVariant {
    /// Short name for tables.
    pub name: String,
    /// The make binary.
    pub make: PathBuf,
    /// Run under `herdless run -j N` (the make gets no `-j`).
    pub under_run: bool,
    /// Extra environment.
    pub env: Vec<(String, String)>,
}

/// The tree and the pool.
#[derive(Clone, Debug)]
pub struct MakeConfig {
    /// The `herdless` binary (for the bridge variant).
    pub exe: PathBuf,
    /// Sub-makes the top make runs.
    pub subs: u32,
    /// Jobs per sub-make.
    pub per: u32,
    /// How long each job sleeps, in milliseconds.
    pub job_ms: u32,
    /// `-j`.
    pub jobs: u32,
    /// Runs per variant (the figures are the median run by wall time).
    pub repeat: u32,
    /// Jobs of mixed lengths ([`MIX`] times `job_ms`), not all `job_ms`.
    pub mix: bool,
}

/// The weights of `job_ms` that the jobs of a sub-make sleep, in turn,
/// with [`MakeConfig::mix`].
pub const MIX: [u32; 8] = [1, 1, 1, 2, 2, 4, 10, 20];

/// How often the sampler counts the jobs running.
const SAMPLE: Duration = Duration::from_millis(2);

/// The figures of one variant.
#[derive(Clone, Debug, Serialize)]
pub struct MakeResult {
    /// The variant's name.
    pub variant: String,
    /// Wall time of the whole tree, seconds.
    pub wall_s: f64,
    /// User + system CPU of the whole tree, seconds.
    pub cpu_s: f64,
    /// Voluntary context switches of the makes and the broker.
    pub makes_vcsw: u64,
    /// Of those, per job.
    pub makes_vcsw_per_job: f64,
    /// Voluntary context switches of the whole tree, jobs included.
    pub tree_vcsw: u64,
    /// Make (and broker) processes that reported.
    pub makes: u32,
    /// Jobs run.
    pub jobs_run: usize,
    /// The most jobs running at once.
    pub most_at_once: u32,
    /// Slot-seconds left unused while some job had yet to start (see the
    /// module docs).
    pub idle_slot_s: f64,
    /// Those as a share of N × the time from the first job's start to the
    /// last's.
    pub idle_share: f64,
    /// Exit status of the top command.
    pub ok: bool,
    /// Wake-ups of the broker's own thread inside the top make (counted
    /// in `makes_vcsw`): its voluntary context switches, from the line the
    /// make writes to `HERDLESS_MAKE_STATS`. `None` without such a broker,
    /// or where the OS does not count them per thread.
    pub broker_vcsw: Option<u64>,
    /// Grants to a make that waited for them, from the same line: each
    /// costs that make at most one voluntary context switch (counted in
    /// `makes_vcsw`; none when the make was still running as its grant
    /// came). `None` without such a broker.
    pub woken: Option<u64>,
    /// Waits in the shared table that the broker moved to its queue, from
    /// the same line. A make waits in its poll loop, which the move does
    /// not wake: its grant comes over the socket, counted in `woken`.
    pub moved: Option<u64>,
}

impl MakeResult {
    /// The makes' switches less the broker thread's and one per grant to
    /// a make that waited: at most what the makes' own work costs (forking
    /// jobs, reaping them), to set beside a make that never waits for a
    /// token. `None` without the broker's and the woken figures.
    pub fn own_vcsw(&self) -> Option<u64> {
        Some(
            self.makes_vcsw
                .saturating_sub(self.broker_vcsw?)
                .saturating_sub(self.woken?),
        )
    }
}

/// What the top make's `HERDLESS_MAKE_STATS` line says of its broker.
#[derive(Debug, Default, PartialEq, Eq)]
struct BrokerFigures {
    broker_vcsw: Option<u64>,
    woken: Option<u64>,
    moved: Option<u64>,
}

/// The figures of the top make's `HERDLESS_MAKE_STATS` line ("key value"
/// pairs; the last line wins); a negative figure is "not counted".
fn broker_figures(stats: &str) -> BrokerFigures {
    let Some(line) = stats.lines().rev().find(|l| !l.trim().is_empty()) else {
        return BrokerFigures::default();
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let figure = |key: &str| {
        words
            .chunks(2)
            .find(|kv| kv.len() == 2 && kv[0] == key)
            .and_then(|kv| kv[1].parse::<i64>().ok())
            .and_then(|n| u64::try_from(n).ok())
    };
    BrokerFigures {
        broker_vcsw: figure("broker_vcsw"),
        woken: figure("woken"),
        moved: figure("moved"),
    }
}

const JOB_SH: &str = r#"#!/bin/sh
dir=$1
secs=${2:-$JOB_SLEEP}
mkdir "$dir/running/$$"
set -- "$dir"/running/*
echo "$#" >> "$dir/peaks"
sleep "$secs"
rmdir "$dir/running/$$"
echo x >> "$dir/done"
"#;

/// The preload library: each make-like process appends its own rusage.
const PRELOAD_C: &str = r#"
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

__attribute__((destructor)) static void herdless_bench_rusage(void) {
    const char *out = getenv("HERDLESS_BENCH_RUSAGE");
    char comm[64] = "";
    FILE *f;
    struct rusage ru;
    if (!out) return;
    f = fopen("/proc/self/comm", "r");
    if (!f) return;
    if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
    fclose(f);
    comm[strcspn(comm, "\n")] = 0;
    if (!strstr(comm, "make") && strcmp(comm, "herdless")) return;
    if (getrusage(RUSAGE_SELF, &ru)) return;
    char line[160];
    int n = snprintf(line, sizeof line, "%s %ld %ld\n", comm, ru.ru_nvcsw, ru.ru_nivcsw);
    int fd = open(out, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (fd < 0) return;
    if (write(fd, line, (size_t)n) < 0) {}
    close(fd);
}
"#;

fn children_usage() -> (f64, u64) {
    // getrusage(RUSAGE_CHILDREN) does not fail for this process; zeros
    // would show in the figures if it ever did.
    let u = herdless_platform::children_rusage().unwrap_or_default();
    (u.cpu().as_secs_f64(), u.voluntary_ctx)
}

/// A scratch directory with the tree's Makefiles and the preload library.
pub struct Workspace {
    dir: PathBuf,
    preload: PathBuf,
}

impl Workspace {
    /// Writes the tree and compiles the preload library (with `cc`, or
    /// `$CC`).
    pub fn new(cfg: &MakeConfig) -> std::io::Result<Workspace> {
        let dir = std::env::temp_dir().join(format!("herdless-bench-make-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        fs::write(dir.join("job.sh"), JOB_SH)?;
        let d = dir.display();
        let mut sub = String::from("all:");
        for j in 1..=cfg.per {
            write!(sub, " j{j}").unwrap();
        }
        sub.push('\n');
        for j in 1..=cfg.per {
            if cfg.mix {
                let w = MIX[(j as usize - 1) % MIX.len()];
                let secs = f64::from(cfg.job_ms * w) / 1000.0;
                writeln!(sub, "j{j}:\n\t@sh {d}/job.sh {d}/run {secs:.3}").unwrap();
            } else {
                writeln!(sub, "j{j}:\n\t@sh {d}/job.sh {d}/run").unwrap();
            }
        }
        fs::write(dir.join("sub.mk"), sub)?;
        let mut top = String::from("all:");
        for s in 1..=cfg.subs {
            write!(top, " s{s}").unwrap();
        }
        top.push('\n');
        for s in 1..=cfg.subs {
            writeln!(top, "s{s}:\n\t@${{MAKE}} -f {d}/sub.mk").unwrap();
        }
        fs::write(dir.join("Makefile"), top)?;
        fs::write(dir.join("preload.c"), PRELOAD_C)?;
        let preload = dir.join("preload.so");
        let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
        let out = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&preload)
            .arg(dir.join("preload.c"))
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "cannot compile the rusage preload library: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(Workspace { dir, preload })
    }

    fn reset(&self) -> std::io::Result<PathBuf> {
        let run = self.dir.join("run");
        let _ = fs::remove_dir_all(&run);
        fs::create_dir_all(run.join("running"))?;
        Ok(run)
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Runs the tree once with `v`.
pub fn run_once(cfg: &MakeConfig, ws: &Workspace, v: &MakeVariant) -> std::io::Result<MakeResult> {
    let run = ws.reset()?;
    let rusage = run.join("rusage");
    let stats = run.join("stats");
    let mut cmd = if v.under_run {
        let mut c = Command::new(&cfg.exe);
        c.args(["run", "-j", &cfg.jobs.to_string(), "--"])
            .arg(&v.make)
            .arg("-f")
            .arg(ws.dir.join("Makefile"));
        c
    } else {
        let mut c = Command::new(&v.make);
        c.arg(format!("-j{}", cfg.jobs))
            .arg("-f")
            .arg(ws.dir.join("Makefile"));
        c
    };
    for var in [
        "HERDLESS_SOCKET",
        "MAKEFLAGS",
        "MFLAGS",
        "MAKELEVEL",
        "CARGO_MAKEFLAGS",
        "HERDLESS_MAKE",
    ] {
        cmd.env_remove(var);
    }
    let mut preload = OsString::from(&ws.preload);
    if let Some(old) = std::env::var_os("LD_PRELOAD") {
        preload.push(" ");
        preload.push(old);
    }
    cmd.env("LD_PRELOAD", preload)
        .env("HERDLESS_BENCH_RUSAGE", &rusage)
        .env("HERDLESS_MAKE_STATS", &stats)
        .env(
            "JOB_SLEEP",
            format!("{:.3}", f64::from(cfg.job_ms) / 1000.0),
        )
        .current_dir(&ws.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, val) in &v.env {
        cmd.env(k, val);
    }
    let (cpu0, vcsw0) = children_usage();
    let start = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        let run = run.clone();
        let total = (cfg.subs * cfg.per) as usize;
        let jobs = cfg.jobs;
        std::thread::spawn(move || idle_slots(&run, total, jobs, &done))
    };
    let status = cmd.status();
    let wall = start.elapsed();
    done.store(true, Ordering::SeqCst);
    let (idle_slot_s, idle_share) = sampler.join().unwrap_or((0.0, 0.0));
    let status = status?;
    let (cpu1, vcsw1) = children_usage();
    let reports = fs::read_to_string(&rusage).unwrap_or_default();
    let mut makes = 0;
    let mut makes_vcsw = 0u64;
    for line in reports.lines() {
        let mut w = line.split_whitespace().skip(1);
        if let Some(n) = w.next().and_then(|n| n.parse::<u64>().ok()) {
            makes += 1;
            makes_vcsw += n;
        }
    }
    let broker = broker_figures(&fs::read_to_string(&stats).unwrap_or_default());
    let jobs_run = fs::read_to_string(run.join("done"))
        .unwrap_or_default()
        .lines()
        .count();
    let most = fs::read_to_string(run.join("peaks"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .max()
        .unwrap_or(0);
    Ok(MakeResult {
        variant: v.name.clone(),
        wall_s: wall.as_secs_f64(),
        cpu_s: cpu1 - cpu0,
        makes_vcsw,
        makes_vcsw_per_job: makes_vcsw as f64 / jobs_run.max(1) as f64,
        tree_vcsw: vcsw1 - vcsw0,
        makes,
        jobs_run,
        most_at_once: most,
        idle_slot_s,
        idle_share,
        ok: status.success(),
        broker_vcsw: broker.broker_vcsw,
        woken: broker.woken,
        moved: broker.moved,
    })
}

/// Samples the jobs running in `run` every [`SAMPLE`] or so until `done`:
/// returns the slot-seconds left unused out of `jobs` from the first job's
/// start until all `total` had started, and their share of `jobs` × that
/// span.
fn idle_slots(run: &std::path::Path, total: usize, jobs: u32, done: &AtomicBool) -> (f64, f64) {
    let running_dir = run.join("running");
    let peaks = run.join("peaks");
    let mut idle = 0.0;
    let mut span = 0.0;
    // Each sample stands for the time since the one before: on a busy
    // machine the sampler may run late, never early.
    let mut last: Option<(Instant, u32)> = None;
    while !done.load(Ordering::SeqCst) {
        // One line per job started.
        let started = fs::read(&peaks)
            .map(|b| b.iter().filter(|&&c| c == b'\n').count())
            .unwrap_or(0);
        let now = Instant::now();
        if let Some((then, free)) = last {
            let dt = (now - then).as_secs_f64();
            idle += f64::from(free) * dt;
            span += dt;
        }
        if started >= total {
            break;
        }
        last = (started > 0).then(|| {
            let running = fs::read_dir(&running_dir).map(|d| d.count()).unwrap_or(0);
            let running = u32::try_from(running).unwrap_or(u32::MAX);
            (now, jobs.saturating_sub(running))
        });
        std::thread::sleep(SAMPLE);
    }
    let share = if span > 0.0 {
        idle / (f64::from(jobs) * span)
    } else {
        0.0
    };
    (idle, share)
}

/// Runs every variant `cfg.repeat` times, interleaved (variant A, B, C, A,
/// B, C, …) so that a change in the machine's load hits all alike, and
/// keeps each variant's median run by wall time.
pub fn run_all(
    cfg: &MakeConfig,
    variants: &[MakeVariant],
    mut progress: impl FnMut(&str),
) -> std::io::Result<Vec<MakeResult>> {
    let ws = Workspace::new(cfg)?;
    let mut runs: Vec<Vec<MakeResult>> = vec![Vec::new(); variants.len()];
    for round in 0..cfg.repeat {
        for (i, v) in variants.iter().enumerate() {
            progress(&format!("{} (round {}/{})", v.name, round + 1, cfg.repeat));
            runs[i].push(run_once(cfg, &ws, v)?);
        }
    }
    Ok(runs
        .into_iter()
        .map(|mut r| {
            r.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
            r.swap_remove(r.len() / 2)
        })
        .collect())
}

/// The results as a table, with ratios to the first variant.
pub fn table(results: &[MakeResult]) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "{:<26} {:>8} {:>8} {:>10} {:>9} {:>7} {:>7} {:>6} {:>10} {:>6} {:>6} {:>8} {:>6} {:>5}",
        "variant",
        "wall s",
        "CPU s",
        "makes vcsw",
        "per job",
        "broker",
        "woken",
        "moved",
        "tree vcsw",
        "jobs",
        "most",
        "idle s·N",
        "idle %",
        "ok"
    )
    .unwrap();
    for r in results {
        writeln!(
            out,
            "{:<26} {:>8.2} {:>8.2} {:>10} {:>9.2} {:>7} {:>7} {:>6} {:>10} {:>6} {:>6} {:>8.2} {:>6.1} {:>5}",
            r.variant,
            r.wall_s,
            r.cpu_s,
            r.makes_vcsw,
            r.makes_vcsw_per_job,
            dash(r.broker_vcsw),
            dash(r.woken),
            dash(r.moved),
            r.tree_vcsw,
            r.jobs_run,
            r.most_at_once,
            r.idle_slot_s,
            r.idle_share * 100.0,
            if r.ok { "yes" } else { "NO" }
        )
        .unwrap();
    }
    if let Some(base) = results.first() {
        writeln!(out, "\nratios to {}:", base.variant).unwrap();
        for r in &results[1..] {
            writeln!(
                out,
                "{:<26} wall {:.2}  CPU {:.2}  makes' vcsw per job {:.2}",
                r.variant,
                r.wall_s / base.wall_s,
                r.cpu_s / base.cpu_s,
                r.makes_vcsw_per_job / base.makes_vcsw_per_job.max(f64::MIN_POSITIVE)
            )
            .unwrap();
        }
    }
    let own: Vec<(&MakeResult, u64)> = results
        .iter()
        .filter_map(|r| r.own_vcsw().map(|o| (r, o)))
        .collect();
    if !own.is_empty() {
        writeln!(
            out,
            "\nmakes' vcsw less the broker's thread and one per grant to a make that waited:"
        )
        .unwrap();
        for (r, o) in own {
            writeln!(
                out,
                "{:<26} {:>6}  per job {:.2}",
                r.variant,
                o,
                o as f64 / r.jobs_run.max(1) as f64
            )
            .unwrap();
        }
    }
    out
}

fn dash(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

/// A bar chart (SVG) of the makes' voluntary context switches per job.
pub fn svg(results: &[MakeResult], caption: &str) -> String {
    let width = 720.0;
    let bar_h = 28.0;
    let left = 230.0;
    let top = 40.0;
    let height = top + bar_h * results.len() as f64 + 50.0;
    let max = results
        .iter()
        .map(|r| r.makes_vcsw_per_job)
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"13\">\n\
         <text x=\"10\" y=\"22\" font-size=\"15\">Voluntary context switches of the makes and the broker, per job</text>\n"
    );
    for (i, r) in results.iter().enumerate() {
        let y = top + bar_h * i as f64;
        let w = (width - left - 80.0) * r.makes_vcsw_per_job / max;
        let _ = writeln!(
            s,
            "<text x=\"10\" y=\"{ty}\">{name}</text>\
             <rect x=\"{left}\" y=\"{y}\" width=\"{w:.1}\" height=\"{h}\" fill=\"#4a7ab5\"/>\
             <text x=\"{tx:.1}\" y=\"{ty}\">{v:.2}</text>",
            ty = y + bar_h * 0.65,
            name = r.variant,
            h = bar_h - 8.0,
            tx = left + w + 6.0,
            v = r.makes_vcsw_per_job
        );
    }
    let _ = write!(
        s,
        "<text x=\"10\" y=\"{}\" font-size=\"11\">{}</text>\n</svg>\n",
        height - 16.0,
        caption
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_figures_come_from_the_last_stats_line() {
        let line = "jobs 4 native_grants 9 classic_offered 0 max_in_use 3 reclaimed 0 \
                    lost 0 woken 5 broker_vcsw 12\n";
        let all = |b, w, m| BrokerFigures {
            broker_vcsw: b,
            woken: w,
            moved: m,
        };
        assert_eq!(broker_figures(line), all(Some(12), Some(5), None));
        let two = format!(
            "jobs 4 woken 1 broker_vcsw 2 moved 1\n{} moved 7\n",
            line.trim()
        );
        assert_eq!(broker_figures(&two), all(Some(12), Some(5), Some(7)));
        // Not counted per thread; an older line without the figures; none.
        assert_eq!(
            broker_figures("woken 3 broker_vcsw -1"),
            all(None, Some(3), None)
        );
        assert_eq!(broker_figures("jobs 4 lost 0"), BrokerFigures::default());
        assert_eq!(broker_figures(""), BrokerFigures::default());
    }
}
