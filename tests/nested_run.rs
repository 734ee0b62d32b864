//! `herdless run` as a recipe of a real make (GNU make 4.3, pipe style;
//! GNU make 4.4.1, fifo style; bmake, `-J`): its pool borrows its shared
//! tokens from the outer jobserver. Every job records how many jobs run at
//! once in the whole build and in its own subtree; the tests assert the
//! outer `-j` bounds the build and is reached, each inner `-j` bounds its
//! subtree, every job ends, and every outer token is back afterwards
//! (counted in the test's own pipe, and by GNU make itself when it owns
//! the jobserver). Stop signals to the inner run give its tokens back.
//!
//! A test that needs a program that is missing fails and says how to get
//! it; none passes without running.

mod classic_client_support;
mod common;

use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use classic_client_support::{
    assert_tokens_back, clean, herdless, run, serial, text, Make, Ran, Server, TempDir, TokenPipe,
};

/// Jobs that record, at start and while they wait, how many run at once
/// in the whole build (`run/`) and in their subtree (`run-NAME/`), both
/// inside their token's hold, so a count never exceeds the jobs that hold
/// tokens. A job started before the build reached `want` jobs at once
/// waits (bounded, 20 s) until it does, so the limit is reached.
struct Tree {
    dir: TempDir,
}

const JOB: &str = r#"#!/bin/sh
# job.sh DIR SUBTREE WANT
d=$1; s=$2; want=$3
mkdir -p "$d/run-$s"
: > "$d/run/$$"; : > "$d/run-$s/$$"
count() { echo "$(ls "$d/run" | wc -l) $(ls "$d/run-$s" | wc -l) $s $(cat "$d/done" 2>/dev/null | wc -l)" >> "$d/peaks"; }
count
if [ "$(ls "$d/run" | wc -l)" -ge "$want" ]; then : > "$d/reached"; fi
i=0
while [ ! -e "$d/reached" ] && [ $i -lt 400 ]; do
  sleep 0.05
  count
  if [ "$(ls "$d/run" | wc -l)" -ge "$want" ]; then : > "$d/reached"; fi
  i=$((i+1))
done
sleep 0.05
count
rm -f "$d/run/$$" "$d/run-$s/$$"
echo "$$" >> "$d/done"
"#;

impl Tree {
    fn new(tag: &str) -> Tree {
        let dir = TempDir::new(tag);
        fs::create_dir(dir.path().join("run")).unwrap();
        let script = dir.path().join("job.sh");
        fs::write(&script, JOB).unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        Tree { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn job(&self, subtree: &str, want: u32) -> String {
        let d = self.path().display();
        format!("sh {d}/job.sh {d} {subtree} {want}")
    }

    fn peaks(&self) -> Vec<(u32, u32, String, u32)> {
        fs::read_to_string(self.path().join("peaks"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                Some((
                    w.next()?.parse().ok()?,
                    w.next()?.parse().ok()?,
                    w.next()?.to_string(),
                    w.next()?.parse().ok()?,
                ))
            })
            .collect()
    }

    /// The most jobs at once in the whole build.
    fn peak(&self) -> u32 {
        self.peaks().iter().map(|p| p.0).max().unwrap_or(0)
    }

    /// The most jobs at once in one subtree.
    fn peak_of(&self, subtree: &str) -> u32 {
        self.peaks()
            .iter()
            .filter(|p| p.2 == subtree)
            .map(|p| p.1)
            .max()
            .unwrap_or(0)
    }

    /// Whether `subtree` ran `n` jobs at once before any job had ended:
    /// it did not wait for a token to come back while tokens were to be
    /// had.
    fn reached_before_any_ended(&self, subtree: &str, n: u32) -> bool {
        self.peaks()
            .iter()
            .any(|p| p.2 == subtree && p.1 >= n && p.3 == 0)
    }

    fn done(&self) -> usize {
        fs::read_to_string(self.path().join("done"))
            .unwrap_or_default()
            .lines()
            .count()
    }

    fn running(&self) -> usize {
        fs::read_dir(self.path().join("run")).unwrap().count()
    }
}

/// The inner `-j` of the script recipes, and how many jobs each starts.
const INNER: u32 = 3;
const PER_SCRIPT: u32 = 6;
const SCRIPTS: [&str; 3] = ["r1", "r2", "r3"];
/// The inner `-j` of the recipe that runs a stock make, and its jobs.
const INNER_MAKE: u32 = 2;
const PER_MAKE: u32 = 6;

/// A Makefile whose recipes are `herdless run -j 3 -- sh -c '…'` starting
/// six `herdless exec` jobs in the background each, and one `herdless run
/// -j 2 -- MAKE -f sub.mk` whose stock make runs six jobs (without `-j`:
/// it takes the inner pool's from MAKEFLAGS). `mark` puts GNU make's `+`
/// or bmake's `.MAKE` on the recipes.
fn makefile(make: Make, tree: &Tree, want: u32, mark: bool, inner: &str) -> String {
    let h = herdless();
    let mut mk = String::new();
    let all: Vec<&str> = SCRIPTS.iter().copied().chain(["m"]).collect();
    writeln!(mk, ".PHONY: all {}", all.join(" ")).unwrap();
    writeln!(mk, "all: {}", all.join(" ")).unwrap();
    let (plus, dot_make) = match (make, mark) {
        (Make::Bmake, true) => ("", " .MAKE"),
        (_, true) => ("+", ""),
        (_, false) => ("", ""),
    };
    let loop_ = (1..=PER_SCRIPT)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(" ");
    for s in SCRIPTS {
        writeln!(mk, "{s}:{dot_make}").unwrap();
        writeln!(
            mk,
            "\t{plus}@{h} run -j {INNER} {inner} -- sh -c 'for i in {loop_}; do {h} exec -- {} & done; wait'",
            tree.job(s, want)
        )
        .unwrap();
    }
    let sub = tree.path().join("sub.mk");
    let targets: Vec<String> = (1..=PER_MAKE).map(|i| format!("s{i}")).collect();
    let mut submk = format!(".PHONY: all {0}\nall: {0}\n", targets.join(" "));
    for t in &targets {
        writeln!(submk, "{t}:\n\t@{}", tree.job("m", want)).unwrap();
    }
    fs::write(&sub, submk).unwrap();
    writeln!(mk, "m:{dot_make}").unwrap();
    writeln!(
        mk,
        "\t{plus}@{h} run -j {INNER_MAKE} {inner} -- {} -f {}",
        make.program().display(),
        sub.display()
    )
    .unwrap();
    mk
}

fn total_jobs() -> usize {
    (SCRIPTS.len() as u32 * PER_SCRIPT + PER_MAKE) as usize
}

/// The outer jobserver.
#[derive(Clone, Copy)]
enum Outer {
    /// The test's own pipe (GNU make 4.3, bmake) or fifo (GNU make 4.4.1)
    /// holding `jobs - 1` tokens, named in MAKEFLAGS: make runs as a
    /// sub-make, and the tokens are counted afterwards.
    External { jobs: u32 },
    /// `make -jN`: make owns the jobserver, and GNU make counts its tokens
    /// when it exits.
    Direct { jobs: u32 },
}

fn run_make(make: Make, outer: Outer, tree: &Tree, mark: bool, inner: &str) -> Ran {
    let jobs = match outer {
        Outer::External { jobs } | Outer::Direct { jobs } => jobs,
    };
    let mf = tree.path().join("Makefile");
    fs::write(&mf, makefile(make, tree, jobs, mark, inner)).unwrap();
    run_makefile(make, outer, &mf, tree.path()).0
}

fn text_of(outer: Outer) -> String {
    match outer {
        Outer::External { jobs } => format!("under an outer jobserver of -j{jobs}"),
        Outer::Direct { jobs } => format!("-j{jobs}"),
    }
}

/// Everything ran, nothing was lost, and no subtree or the whole build
/// ran more jobs than its `-j`.
fn check(make: Make, outer: Outer, ran: &Ran, tree: &Tree) {
    let jobs = match outer {
        Outer::External { jobs } | Outer::Direct { jobs } => jobs,
    };
    let what = format!("{make:?} {}", text_of(outer));
    let out = &ran.out;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what}: {}", text(out));
    assert!(!stderr.contains("INTERNAL"), "{what}: {}", text(out));
    assert!(!stderr.contains("jobserver"), "{what}: {}", text(out));
    assert!(!stderr.contains("warning"), "{what}: {}", text(out));
    assert_eq!(tree.done(), total_jobs(), "{what}: {}", text(out));
    assert_eq!(tree.running(), 0, "{what}");
    assert_eq!(
        tree.peak(),
        jobs,
        "{what}: at most {jobs} jobs at once in the build, and {jobs} reached\n{}",
        text(out)
    );
    for s in SCRIPTS {
        let peak = tree.peak_of(s);
        assert!(
            (1..=INNER.min(jobs)).contains(&peak),
            "{what}: subtree {s} ran {peak} jobs at once (-j {INNER})"
        );
    }
    let peak = tree.peak_of("m");
    assert!(
        (1..=INNER_MAKE.min(jobs)).contains(&peak),
        "{what}: the inner make ran {peak} jobs at once (-j {INNER_MAKE})"
    );
    if let Some(left) = &ran.left {
        assert_tokens_back(make, left, jobs as usize - 1, &what);
    }
}

fn nested_runs_share_the_outer_pool(make: Make) {
    let _serial = serial();
    for jobs in [1, 2, 4] {
        let tree = Tree::new(&format!("nested-{jobs}"));
        let outer = Outer::External { jobs };
        let ran = run_make(make, outer, &tree, true, "");
        check(make, outer, &ran, &tree);
    }
    for jobs in [2, 4] {
        let tree = Tree::new(&format!("nested-direct-{jobs}"));
        let outer = Outer::Direct { jobs };
        let ran = run_make(make, outer, &tree, true, "");
        check(make, outer, &ran, &tree);
    }
}

#[test]
fn under_gnu_make_43_pipe() {
    nested_runs_share_the_outer_pool(Make::Gnu43);
}

#[test]
fn under_gnu_make_441_fifo() {
    nested_runs_share_the_outer_pool(Make::Gnu441);
}

#[test]
fn under_bmake() {
    nested_runs_share_the_outer_pool(Make::Bmake);
}

/// Runs `make -f mf` in `dir` under `outer`; returns what ran and its name.
fn run_makefile(make: Make, outer: Outer, mf: &Path, dir: &Path) -> (Ran, String) {
    let mut cmd = clean(make.program());
    cmd.arg("-f").arg(mf).current_dir(dir);
    let what = format!("{make:?} {}", text_of(outer));
    let server = match outer {
        Outer::External { jobs } => Server::External {
            tokens: jobs as usize - 1,
        },
        Outer::Direct { jobs } => Server::Direct { jobs },
    };
    let ran = classic_client_support::run_make(make, server, &mut cmd, dir, &what);
    (ran, what)
}

/// One recipe that starts eight `herdless run -j 2` at once, each running
/// one job, under each make's `-j3`: each run takes its command's token
/// from the outer jobserver as `exec` does (the recipe's slot for one of
/// them, a token from the pipe for the others), where each used to count
/// on the recipe's slot and all eight ran at once (8 jobs at `-j3`, under
/// GNU make 4.4.1 as under the others). At most 3 at once, 3 reached,
/// every job, every token back. Each run's own pool, whose command reads
/// no jobserver, lends its classic pipe a token of the outer jobserver only
/// for a while (`herdless::bridge`, "Backed pools"): one kept there for
/// the whole run left the other runs short, and 3 were reached in about
/// half the runs, after minutes.
fn runs_started_together_share_the_recipe_s_slot(make: Make) {
    let _serial = serial();
    let jobs = 3;
    let tree = Tree::new("nested-together");
    let h = herdless();
    let (plus, dot_make) = match make {
        Make::Bmake => ("", " .MAKE"),
        _ => ("+", ""),
    };
    let mf = tree.path().join("Makefile");
    fs::write(
        &mf,
        format!(
            "all:{dot_make}\n\t{plus}@for i in 1 2 3 4 5 6 7 8; do {h} run -j 2 -- {} & done; wait\n",
            tree.job("t", jobs)
        ),
    )
    .unwrap();
    for outer in [Outer::External { jobs }, Outer::Direct { jobs }] {
        let _ = fs::remove_file(tree.path().join("done"));
        let _ = fs::remove_file(tree.path().join("peaks"));
        let _ = fs::remove_file(tree.path().join("reached"));
        let (ran, what) = run_makefile(make, outer, &mf, tree.path());
        let out = &ran.out;
        assert!(out.status.success(), "{what}: {}", text(out));
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("INTERNAL"),
            "{what}: {}",
            text(out)
        );
        assert_eq!(tree.done(), 8, "{what}: {}", text(out));
        assert_eq!(
            tree.peak(),
            jobs,
            "{what}: at most {jobs} jobs at once, and {jobs} reached\n{}",
            text(out)
        );
        if let Some(left) = &ran.left {
            assert_tokens_back(make, left, jobs as usize - 1, &what);
        }
    }
}

#[test]
fn runs_started_together_under_gnu_make_43_share_the_recipe_s_slot() {
    runs_started_together_share_the_recipe_s_slot(Make::Gnu43);
}

#[test]
fn runs_started_together_under_gnu_make_441_share_the_recipe_s_slot() {
    runs_started_together_share_the_recipe_s_slot(Make::Gnu441);
}

#[test]
fn runs_started_together_under_bmake_share_the_recipe_s_slot() {
    runs_started_together_share_the_recipe_s_slot(Make::Bmake);
}

/// Two `herdless run` started together by one recipe and stopped by
/// `SIGTERM` (`timeout -s TERM`) while their commands run: one runs on the
/// recipe's slot, the other on a byte it read from the outer jobserver,
/// which it must write back before it dies of the signal it passes on.
/// It used to die holding it: GNU make 4.3 then said "INTERNAL: Exiting
/// with 2 jobserver tokens available; should be 3!". Every token is back,
/// in the test's own pipe and in GNU make's count.
#[test]
fn runs_stopped_by_a_signal_give_the_command_s_token_back() {
    let _serial = serial();
    let make = Make::Gnu43;
    let jobs = 3;
    let tree = Tree::new("nested-together-stopped");
    let h = herdless();
    let mf = tree.path().join("Makefile");
    fs::write(
        &mf,
        format!(
            "all:\n\t+@for i in 1 2; do timeout -s TERM 1 {h} run -j 2 -- sleep 30 & done; wait\n"
        ),
    )
    .unwrap();
    for outer in [Outer::External { jobs }, Outer::Direct { jobs }] {
        let (ran, what) = run_makefile(make, outer, &mf, tree.path());
        let out = &ran.out;
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("INTERNAL"),
            "{what}: {}",
            text(out)
        );
        if let Some(left) = &ran.left {
            assert_tokens_back(make, left, jobs as usize - 1, &what);
        }
    }
}

/// A recipe not marked `+`: GNU make closes its jobserver descriptors for
/// it, so the inner run cannot borrow; it says so, as GNU make does, and
/// runs in a pool of its own.
#[test]
fn unmarked_recipe_falls_back_with_a_warning() {
    let _serial = serial();
    let tree = Tree::new("nested-unmarked");
    let ran = run_make(Make::Gnu43, Outer::Direct { jobs: 2 }, &tree, false, "");
    let out = &ran.out;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", text(out));
    assert!(
        stderr.contains("herdless: warning: jobserver unavailable")
            && stderr.contains("Add '+' to the parent make rule."),
        "{}",
        text(out)
    );
    assert!(!stderr.contains("INTERNAL"), "{}", text(out));
    assert_eq!(tree.done(), total_jobs());
}

/// `--new-pool` ignores the outer jobserver and says so: under an outer
/// jobserver of one token, its subtree still reaches its own -j.
#[test]
fn new_pool_warns_and_ignores_the_outer_jobserver() {
    let _serial = serial();
    let tree = Tree::new("nested-new-pool");
    let job = tree.job("n", 3);
    let pipe = TokenPipe::new(b"");
    let mut cmd = clean(herdless());
    cmd.args(["run", "-j", "3", "--new-pool", "--", "sh", "-c"])
        .arg(format!(
            "for i in 1 2 3 4 5 6; do {} exec -- {job} & done; wait",
            herdless()
        ))
        .env("MAKEFLAGS", format!("-j1 --jobserver-auth={}", pipe.auth()));
    let out = run(&mut cmd, "run --new-pool");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stderr.contains("warning: --new-pool: -j3 forced in a pool of its own"),
        "{}",
        text(&out)
    );
    assert_eq!(tree.done(), 6);
    assert_eq!(tree.peak_of("n"), 3, "the outer -j1 does not bound it");
    assert!(pipe.drain().is_empty());
}

/// How the inner run is ended while its jobs hold borrowed tokens.
#[derive(Clone, Copy, Debug)]
enum Ending {
    Signal(i32),
    /// Its command is killed (SIGKILL): the run itself ends normally.
    CommandKilled,
}

/// Starts `herdless run -j 4` under a pipe of 5 outer tokens, with eight
/// long jobs, waits until it has borrowed its 3, ends it, and counts the
/// pipe: all 5 are back. Returns how the run ended (None: the signal is
/// ignored here, nothing was checked).
fn ending_gives_every_token_back(ending: Ending) -> Option<std::process::ExitStatus> {
    use std::os::unix::process::CommandExt;
    if let Ending::Signal(sig) = ending {
        if common::ignored_here(sig) {
            eprintln!("signal {sig} is ignored here (nohup, a background job?): run leaves it so; not checked");
            return None;
        }
    }
    let _serial = serial();
    let tree = Tree::new("nested-ending");
    let pipe = TokenPipe::new(b"+++++");
    let in_pipe =
        || herdless_platform::bytes_readable(std::os::fd::AsFd::as_fd(&pipe.read)).unwrap();
    let marker = tree.path().join("sh.pid");
    // Through a shell that execs it, so that the run and its command dump
    // no core when SIGQUIT ends them.
    let mut cmd = clean("sh");
    cmd.args([
        "-c",
        "ulimit -c 0 2>/dev/null; exec \"$@\"",
        "sh",
        herdless(),
    ])
    .args(["run", "-j", "4", "--", "sh", "-c"])
    .arg(format!(
        "echo $$ > {}; for i in 1 2 3 4 5 6 7 8; do {} exec -- sleep 60 & done; wait",
        marker.display(),
        herdless()
    ))
    .env("MAKEFLAGS", format!("-j6 --jobserver-auth={}", pipe.auth()))
    .process_group(0)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as i32;
    // Its whole process group (the jobs a killed command leaves behind
    // too) goes when the test ends, whatever it asserted.
    let _group = common::KillGroupOnDrop(pid);
    // Borrowed: 3 of the 5 outer tokens are out of the pipe.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) && !(in_pipe() == 2 && marker.exists()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(in_pipe(), 2, "-j4 borrows 3 outer tokens for its 8 jobs");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(in_pipe(), 2, "and no more");
    match ending {
        Ending::Signal(sig) => send(pid, sig),
        Ending::CommandKilled => {
            let sh: i32 = fs::read_to_string(&marker).unwrap().trim().parse().unwrap();
            send(sh, libc::SIGKILL);
        }
    }
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{ending:?}: herdless run did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let left = pipe.drain();
    assert_eq!(
        left.len(),
        5,
        "{ending:?}: every borrowed token is back, exactly once: {left:?} ({status})"
    );
    Some(status)
}

fn send(pid: i32, sig: i32) {
    let sig = nix::sys::signal::Signal::try_from(sig).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
}

#[test]
fn sigterm_gives_borrowed_tokens_back() {
    ending_gives_every_token_back(Ending::Signal(libc::SIGTERM));
}

#[test]
fn sigint_gives_borrowed_tokens_back() {
    ending_gives_every_token_back(Ending::Signal(libc::SIGINT));
}

#[test]
fn sighup_gives_borrowed_tokens_back() {
    ending_gives_every_token_back(Ending::Signal(libc::SIGHUP));
}

#[test]
fn a_killed_command_gives_borrowed_tokens_back() {
    ending_gives_every_token_back(Ending::CommandKilled);
}

/// Every other signal whose default action ends a process, and that can
/// be caught, ends the run as SIGTERM does: passed on to its command, the
/// borrowed tokens given back, then the run dies of it as its command did.
/// (Uncaught, it killed the run holding 3 of the 5 outer tokens.)
#[test]
fn other_terminating_signals_give_borrowed_tokens_back() {
    use std::os::unix::process::ExitStatusExt;
    for sig in [libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2, libc::SIGALRM] {
        if let Some(status) = ending_gives_every_token_back(Ending::Signal(sig)) {
            assert_eq!(
                status.signal(),
                Some(sig),
                "the run dies of the signal its command died of: {status}"
            );
        }
    }
}

/// An outer bmake that aborted leaves its abort token in the pipe: the
/// inner run reads it when it wants a token, writes it back for the other
/// makes, and aborts its own pool, so its waiting jobs never start.
#[test]
fn an_outer_bmake_abort_token_aborts_the_inner_pool() {
    let _serial = serial();
    let tree = Tree::new("nested-abort");
    let pipe = TokenPipe::new(b"E");
    let mut cmd = clean(herdless());
    cmd.args(["run", "-j", "3", "--stats", "--", "sh", "-c"])
        .arg(format!(
            "for i in 1 2 3 4 5 6; do {} exec -- {} & done; wait",
            herdless(),
            tree.job("a", 1)
        ))
        .env("MAKEFLAGS", format!("-j 4 -J {}", pipe.auth()));
    let out = run(&mut cmd, "run under an aborted bmake");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("herdless: aborted       E"),
        "the inner pool aborted\n{}",
        text(&out)
    );
    assert!(
        tree.done() < 6,
        "jobs waiting for a token never started\n{}",
        text(&out)
    );
    assert_eq!(pipe.drain(), b"E", "the abort token is back for the others");
}

/// A stock make alone in a `herdless run -j 3` under an outer jobserver
/// with tokens to spare: it reads the inner pipe's offers (one at a time,
/// each renewed as it is read) and reaches 3 jobs, never more; every outer
/// byte is back afterwards.
fn inner_make_reaches_its_j(make: Make) {
    let _serial = serial();
    let tree = Tree::new("nested-inner-make");
    let sub = tree.path().join("sub.mk");
    let targets: Vec<String> = (1..=9).map(|i| format!("s{i}")).collect();
    let mut submk = format!(".PHONY: all {0}\nall: {0}\n", targets.join(" "));
    for t in &targets {
        writeln!(submk, "{t}:\n\t@{}", tree.job("m", 3)).unwrap();
    }
    fs::write(&sub, submk).unwrap();
    let pipe = TokenPipe::new(b"+++++");
    let mut cmd = clean(herdless());
    cmd.args(["run", "-j", "3", "--stats", "--"])
        .arg(make.program())
        .arg("-f")
        .arg(&sub)
        .current_dir(tree.path());
    cmd.env("MAKEFLAGS", make.pipe_flags(6, &pipe));
    let out = run(&mut cmd, &format!("run -j 3 -- {make:?}"));
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(tree.done(), 9, "{}", text(&out));
    assert_eq!(
        tree.peak_of("m"),
        3,
        "-j 3 reached, never passed\n{}",
        text(&out)
    );
    if cfg!(target_os = "linux") {
        // Each offer is renewed the moment it is read (the pipe's emptying
        // is an event there), so the make needs no job to end first.
        assert!(
            tree.reached_before_any_ended("m", 3),
            "the inner make waited for a job to end while tokens were to be had\n{}",
            text(&out)
        );
    }
    assert_eq!(
        pipe.drain().len(),
        5,
        "every outer byte back\n{}",
        text(&out)
    );
}

#[test]
fn inner_gnu_make_reaches_its_j() {
    inner_make_reaches_its_j(Make::Gnu43);
}

#[test]
fn inner_bmake_reaches_its_j() {
    inner_make_reaches_its_j(Make::Bmake);
}

/// `herdless run -j 2 -- MAKE` inside `herdless run -j 8`: the nested run
/// joins the outer pool, and its make reads a pipe of the nested run's
/// own, whose tokens are borrowed from the outer pool: the inner -j 2
/// caps the make (it would otherwise read the outer pipe, at -j 8), and
/// the outer pool loses nothing.
fn a_make_in_a_joined_run_is_capped(make: Make) {
    let _serial = serial();
    let tree = Tree::new("joined-make");
    let sub = tree.path().join("sub.mk");
    let targets: Vec<String> = (1..=8).map(|i| format!("s{i}")).collect();
    let mut submk = format!(".PHONY: all {0}\nall: {0}\n", targets.join(" "));
    for t in &targets {
        writeln!(submk, "{t}:\n\t@{}", tree.job("m", 2)).unwrap();
    }
    fs::write(&sub, submk).unwrap();
    let mut cmd = clean(herdless());
    cmd.args(["run", "-j", "8", "--stats", "--", "sh", "-c"])
        .arg(format!(
            "{} run -j 2 --stats -- {} -f {}",
            herdless(),
            make.program().display(),
            sub.display()
        ))
        .env_remove("HERDLESS_SLOT")
        .current_dir(tree.path());
    let out = run(&mut cmd, &format!("run -j 8 -- run -j 2 -- {make:?}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(tree.done(), 8, "{}", text(&out));
    assert_eq!(
        tree.peak_of("m"),
        2,
        "the inner -j 2 caps the make, and is reached\n{}",
        text(&out)
    );
    if cfg!(target_os = "linux") {
        assert!(tree.reached_before_any_ended("m", 2), "{}", text(&out));
    }
    let lost: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("herdless: tokens lost"))
        .collect();
    assert_eq!(lost.len(), 2, "both pools report\n{}", text(&out));
    assert!(lost.iter().all(|l| l.ends_with(" 0")), "{}", text(&out));
    assert!(
        stderr.contains("given back, 0 lost"),
        "the nested pool borrowed from the outer one\n{}",
        text(&out)
    );
}

#[test]
fn a_gnu_make_in_a_joined_run_is_capped() {
    a_make_in_a_joined_run_is_capped(Make::Gnu43);
}

#[test]
fn a_bmake_in_a_joined_run_is_capped() {
    a_make_in_a_joined_run_is_capped(Make::Bmake);
}
