//! `-j N` under any process tree: the implicit token is handed down in
//! `HERDLESS_SLOT`, so the processes a shell puts between a runner and its
//! jobs (subshells, `timeout`, `xargs`, `nohup`, `setsid`, `env`, `nice`,
//! `sh -c`, pipelines) never mint a token; and a stop is a stop.

mod common;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{path_with_bin, signal, stat, wait_timeout, JobTree, BIN, PATIENCE};

fn herdless(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env("PATH", path_with_bin())
        .env_remove("HERDLESS_SOCKET")
        .env_remove("HERDLESS_SLOT")
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL");
    cmd
}

/// How a script starts each of its jobs, `JOB` being the `herdless exec`
/// command line; every one runs the jobs in the background, all at once.
const PATTERNS: [(&str, &str); 11] = [
    ("plain", "for i in $(seq $M); do $JOB & done; wait"),
    (
        "subshell",
        "for i in $(seq $M); do ( $JOB; true ) & done; wait",
    ),
    (
        "group",
        "for i in $(seq $M); do { $JOB; true; } & done; wait",
    ),
    (
        "timeout",
        "for i in $(seq $M); do timeout 60 $JOB & done; wait",
    ),
    ("xargs", "seq $M | xargs -P$M -I{} sh -c \"$JOB; :\""),
    (
        "nohup",
        "for i in $(seq $M); do nohup $JOB >/dev/null 2>&1 & done; wait",
    ),
    (
        "setsid",
        "for i in $(seq $M); do setsid -w $JOB & done; wait",
    ),
    ("env", "for i in $(seq $M); do env X=1 $JOB & done; wait"),
    ("nice", "for i in $(seq $M); do nice $JOB & done; wait"),
    (
        "sh-c",
        "for i in $(seq $M); do sh -c \"$JOB; true\" & done; wait",
    ),
    ("pipeline", "for i in $(seq $M); do $JOB | cat & done; wait"),
];

/// Runs `pattern` with 3N + 2 jobs under `herdless run -j N`; returns
/// (jobs done, most at once, the broker's "max in use").
fn run_pattern(name: &str, script: &str, jobs: u32) -> (usize, u32, u32) {
    let tree = JobTree::new(&format!("pattern-{name}-{jobs}"));
    let job = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
    let m = 3 * jobs + 2;
    let mut cmd = herdless(&["run", "-j", &jobs.to_string(), "--stats", "--", "sh", "-c"]);
    cmd.arg(script).env("JOB", &job).env("M", m.to_string());
    let out = common::output_within(&mut cmd, PATIENCE * 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} -j {jobs}: {stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, m as usize, "{name} -j {jobs}: every job finished");
    let in_use = stat(&stderr, "max in use").parse().unwrap();
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    (done, max, in_use)
}

fn check_pattern(name: &str) {
    let (_, script) = PATTERNS.iter().find(|(n, _)| *n == name).unwrap();
    for jobs in [1, 2, 4] {
        let (_, max, in_use) = run_pattern(name, script, jobs);
        assert!(
            max <= jobs,
            "{name} -j {jobs}: {max} jobs ran at once (the broker saw {in_use})"
        );
        assert_eq!(max, jobs, "{name} -j {jobs}: N jobs at once was reached");
        assert!(in_use <= jobs, "{name} -j {jobs}: max in use {in_use}");
    }
}

#[test]
fn plain_background_jobs() {
    check_pattern("plain");
}

#[test]
fn jobs_in_subshells() {
    check_pattern("subshell");
}

#[test]
fn jobs_in_brace_groups() {
    check_pattern("group");
}

#[test]
fn jobs_under_timeout() {
    check_pattern("timeout");
}

#[test]
fn jobs_from_xargs() {
    check_pattern("xargs");
}

#[test]
fn jobs_under_nohup() {
    check_pattern("nohup");
}

#[test]
fn jobs_under_setsid() {
    check_pattern("setsid");
}

#[test]
fn jobs_under_env() {
    check_pattern("env");
}

#[test]
fn jobs_under_nice() {
    check_pattern("nice");
}

#[test]
fn jobs_in_sh_c() {
    check_pattern("sh-c");
}

#[test]
fn jobs_in_pipelines() {
    check_pattern("pipeline");
}

#[test]
fn a_slot_cannot_be_named_by_accident() {
    // A made-up HERDLESS_SLOT, or one with a broken value, borrows nothing:
    // at -j 1 the job waits for a shared token that does not exist, so it
    // is given a bound and must not have run.
    let tree = JobTree::new("made-up-slot");
    let script = format!(
        "HERDLESS_SLOT=00000000deadbeef/ timeout 2 herdless exec sh {0}/job.sh {0}; \
         echo made-up=$?; \
         HERDLESS_SLOT=garbage timeout 2 herdless exec sh {0}/job.sh {0}; echo garbage=$?",
        tree.dir.display()
    );
    let out = common::output_within(
        &mut herdless(&["run", "-j", "1", "--", "sh", "-c", &script]),
        PATIENCE,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["made-up=124", "garbage=124"],
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(tree.counts().0, 0);
}

#[test]
fn jobs_of_jobs_share_their_runner_token_and_progress_at_j1() {
    // Each outer exec runs four inner jobs through subshells; at -j 1 they
    // all run on the one token, one at a time.
    for jobs in [1u32, 2] {
        let tree = JobTree::new(&format!("nested-{jobs}"));
        let inner = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
        let script = format!(
            "for o in 1 2 3; do herdless exec sh -c 'for i in 1 2 3 4; do ( {inner}; true ) & done; wait' & done; wait"
        );
        let out = common::output_within(
            &mut herdless(&["run", "-j", &jobs.to_string(), "--", "sh", "-c", &script]),
            PATIENCE * 2,
        );
        assert!(out.status.success(), "{out:?}");
        let (done, max) = tree.counts();
        assert_eq!(done, 12);
        assert!(max <= jobs, "-j {jobs}: {max} at once");
    }
}

/// Starts `herdless run -j 2` over a script that queues 40 long jobs, in a
/// process group of its own; waits until two run. Returns the child, the
/// tree, and the script's pid.
fn queued_run(tree: &JobTree) -> (std::process::Child, i32) {
    let script = format!(
        "echo $$ > {0}/script.pid; for i in $(seq 40); do herdless exec sh {0}/job.sh {0} & done; wait",
        tree.dir.display()
    );
    let mut cmd = herdless(&["run", "-j", "2", "--stats", "--", "sh", "-c", &script]);
    cmd.env("JOB_SLEEP", "1.5")
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(tree.path("peaks"))
        .unwrap_or_default()
        .lines()
        .count()
        < 2
    {
        assert!(start.elapsed() < PATIENCE, "the first jobs never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let script_pid = std::fs::read_to_string(tree.path("script.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (child, script_pid)
}

/// Waits until no process of the group is left (the orphaned execs and
/// jobs included), so that any job the broker let start has started.
fn wait_group_gone(pgid: i32) {
    let start = Instant::now();
    while nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), None).is_ok() {
        assert!(start.elapsed() < PATIENCE, "the process group never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn no_job_starts_after_a_stop_signal_or_the_command_s_death() {
    // SIGINT, SIGTERM, SIGHUP to `run`; SIGKILL to its command.
    for (target, sig) in [
        ("run", libc::SIGINT),
        ("run", libc::SIGTERM),
        ("run", libc::SIGHUP),
        ("command", libc::SIGKILL),
    ] {
        if common::ignored_here(sig) {
            eprintln!("signal {sig} is ignored here (nohup?): run leaves it so; not checked");
            continue;
        }
        let tree = JobTree::new(&format!("stop-{target}-{sig}"));
        let (mut child, script) = queued_run(&tree);
        let pid = child.id() as i32;
        signal(if target == "run" { pid } else { script }, sig);
        let status = wait_timeout(&mut child, PATIENCE).expect("run ended");
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        wait_group_gone(pid);
        let started = std::fs::read_to_string(tree.path("peaks"))
            .unwrap_or_default()
            .lines()
            .count();
        assert_eq!(
            started, 2,
            "{target} {sig}: only the two jobs running at the signal ever ran ({status:?})\n{stderr}"
        );
        if target == "command" {
            // `run` ends as its command did, with its report.
            assert_eq!(stat(&stderr, "max in use"), "2", "{stderr}");
            assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
        }
    }
}

#[test]
fn serve_refuses_its_waiters_when_it_stops() {
    // -j 1 and a slot that names nothing: every exec waits for a shared
    // token that never comes; SIGTERM must refuse them all, grant none, and
    // count nothing as taken back.
    let serve = common::Serve::start(1);
    let tree = JobTree::new("serve-stop");
    let execs: Vec<_> = (0..30)
        .map(|_| {
            Command::new(BIN)
                .args(["exec", "sh", &tree.path("job.sh").to_string_lossy()])
                .arg(&tree.dir)
                .env("HERDLESS_SOCKET", &serve.socket)
                .env("HERDLESS_SLOT", "00000000deadbeef/")
                .env_remove("MAKELEVEL")
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    serve.wait_for("30 waiters", |s| s.waiting == 30);
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    for mut e in execs {
        let code = wait_timeout(&mut e, PATIENCE).expect("exec ended").code();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut e.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(code, Some(125), "{err}");
        assert!(err.contains("shutting down"), "{err}");
    }
    assert_eq!(tree.counts().0, 0, "no job ran");
    assert!(stat(&log, "grants").starts_with("0 to native"), "{log}");
    assert_eq!(
        stat(&log, "taken back"),
        "0 from clients that died holding them"
    );
    assert_eq!(stat(&log, "wait"), "p50 0 µs, p99 0 µs, max 0 µs", "{log}");
}

fn require(tool: &str) {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{tool} is not installed: `bash ci/install-tools.sh` installs it (CI does)"
    );
}

/// A Makefile (GNU make and bmake alike) of six targets whose recipes run
/// their jobs through `herdless exec` behind `timeout`, subshells, and two
/// jobs at once in one recipe.
fn exec_makefile(tree: &JobTree) {
    let job = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
    let recipes = [
        format!("timeout 60 {job}"),
        format!("( {job}; true )"),
        format!("{job} & {job}; wait"),
        format!("( timeout 60 {job} ) & ( {job} ); wait"),
        format!("sh -c '{job}; true'"),
        job.to_string(),
    ];
    let mut mk = String::from("all: t1 t2 t3 t4 t5 t6\n");
    for (i, r) in recipes.iter().enumerate() {
        // `+`: GNU make passes its jobserver to marked recipes only.
        mk += &format!("t{}:\n\t@+{r}\n", i + 1);
    }
    std::fs::write(tree.path("Makefile"), mk).unwrap();
}

/// GNU make 4.3 and bmake, alone (classic jobserver) and under `herdless
/// run` (native): at most N jobs at once, all eight done, at -j 1 too
/// (under `run`: a make alone at -j 1 has no jobserver to lend).
#[test]
fn make_recipes_that_exec_through_timeout_and_subshells() {
    for make in ["make", "bmake"] {
        require(make);
        for jobs in [1u32, 2, 4] {
            for under_run in [false, true] {
                if jobs == 1 && !under_run {
                    continue;
                }
                let what = format!("{make} -j {jobs} (under run: {under_run})");
                let tree = JobTree::new(&format!("make-exec-{make}-{jobs}-{under_run}"));
                exec_makefile(&tree);
                let j = jobs.to_string();
                let mut cmd = if under_run {
                    // The make takes -j and the jobserver from MAKEFLAGS;
                    // a -j of its own would make it start a pool of its own.
                    herdless(&["run", "-j", &j, "--", make])
                } else {
                    let mut c = Command::new(make);
                    c.args(["-j", &j])
                        .env("PATH", path_with_bin())
                        .env_remove("HERDLESS_SOCKET")
                        .env_remove("HERDLESS_SLOT")
                        .env_remove("MAKEFLAGS")
                        .env_remove("MAKELEVEL");
                    c
                };
                cmd.current_dir(&tree.dir);
                let out = common::output_within(&mut cmd, PATIENCE * 2);
                assert!(
                    out.status.success(),
                    "{what}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let (done, max) = tree.counts();
                assert_eq!(done, 8, "{what}");
                assert!(max <= jobs, "{what}: {max} at once");
            }
        }
    }
}

/// Jobs of a make recipe whose tree no longer leads to the make: put in
/// the background so that they outlive their shell (reparented to init
/// or a subreaper), or started as the recipe's last, backgrounded command.
/// No recipe is left whose slot they could share: each waits for a shared
/// token. Under `herdless run -j 2 -- make` the orphans run at most 2 at
/// once (a slot per orphaned parent ran all six at once), and every job
/// runs (an `exec` reparented before it read the process table named
/// recipe root 1 and was refused, its job never run, while make exited 0).
/// A backgrounded job that reads the table while its shell still lives
/// runs on the recipe's slot and may outlive the recipe, as a stock make's
/// backgrounded commands do: no bound on those.
#[test]
fn orphaned_recipe_jobs_keep_the_limit_and_all_run() {
    require("make");
    for (name, recipe_jobs, bounded) in [("orphans", true, true), ("background", false, false)] {
        let tree = JobTree::new(&format!("orphaned-recipe-jobs-{name}"));
        let d = tree.dir.display();
        let job = format!("herdless exec sh {d}/job.sh {d}");
        let wait6 = format!(
            "i=0; while [ $$(cat {d}/done 2>/dev/null | wc -l) -lt 6 ] && [ $$i -lt 300 ]; do sleep 0.1; i=$$((i+1)); done"
        );
        let mk = if recipe_jobs {
            format!(
                "all:\n\t@+for i in 1 2 3 4 5 6; do ( ( sleep 0.2; exec {job} ) & ); done; {wait6}\n"
            )
        } else {
            let mut mk = format!("all: bg1 bg2 bg3 bg4 bg5 bg6\n\t@{wait6}\n");
            for i in 1..=6 {
                mk += &format!("bg{i}:\n\t@+{job} &\n");
            }
            mk
        };
        std::fs::write(tree.path("Makefile"), mk).unwrap();
        let mut cmd = herdless(&["run", "-j", "2", "--stats", "--", "make", "-s"]);
        cmd.current_dir(&tree.dir).env("JOB_SLEEP", "0.2");
        let out = common::output_within(&mut cmd, PATIENCE * 2);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        let (done, max) = tree.counts();
        assert_eq!(done, 6, "{name}: every job ran\n{stderr}");
        if bounded {
            assert!(max <= 2, "{name}: {max} jobs at once under -j 2\n{stderr}");
        }
        assert!(!stderr.contains("refused this client"), "{name}: {stderr}");
        assert_eq!(stat(&stderr, "tokens lost"), "0", "{name}: {stderr}");
    }
}

/// A program whose name only ends in "make" (automake, cmake, qmake) is no
/// job runner: the `herdless exec` jobs it starts are jobs of the recipe
/// that started it and share its slot, not each a token of their own
/// (four ran at once under `-j 1` when every such name counted as a make).
#[test]
fn a_program_named_like_a_make_is_no_job_runner() {
    require("make");
    let tree = JobTree::new("named-like-make");
    let d = tree.dir.display();
    let bin = tree.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let automake = bin.join("automake");
    std::fs::write(
        &automake,
        format!("#!/bin/sh\nfor i in 1 2 3 4; do herdless exec sh {d}/job.sh {d} & done; wait\n"),
    )
    .unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(
        &mut std::fs::metadata(&automake).unwrap().permissions(),
        0o755,
    );
    std::fs::set_permissions(
        &automake,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(
        tree.path("Makefile"),
        format!("all:\n\t@+{}\n", automake.display()),
    )
    .unwrap();
    let mut cmd = herdless(&["run", "-j", "1", "--stats", "--", "make", "-s"]);
    cmd.current_dir(&tree.dir);
    let out = common::output_within(&mut cmd, PATIENCE * 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, 4, "{stderr}");
    assert_eq!(max, 1, "-j 1\n{stderr}");
}

/// `herdless run -j OUTER -- sh -c SCRIPT` where SCRIPT starts the inner
/// runs; returns (jobs done, most at once, stderr).
fn nested(tree: &JobTree, outer: u32, script: &str) -> (usize, u32, String) {
    let out = common::output_within(
        &mut herdless(&["run", "-j", &outer.to_string(), "--", "sh", "-c", script]),
        PATIENCE * 2,
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    (done, max, stderr)
}

#[test]
fn nested_runs_join_the_outer_pool() {
    // Three `run -j 4` at once inside `run -j 2`: the outer -j bounds all.
    let tree = JobTree::new("nested-runs");
    let job = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
    let script = format!(
        "for i in 1 2 3; do herdless run -j 4 -- sh -c 'for j in 1 2 3 4; do {job} & done; wait' & done; wait"
    );
    let (done, max, stderr) = nested(&tree, 2, &script);
    assert_eq!(done, 12, "{stderr}");
    assert_eq!(
        max, 2,
        "at most the outer 2 at once, and 2 reached\n{stderr}"
    );
    assert!(!stderr.contains("warning"), "{stderr}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_nested_run_caps_its_own_subtree() {
    // `run -j 2` inside `run -j 8`: its own -j bounds its subtree.
    let tree = JobTree::new("nested-cap");
    let job = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
    let script =
        format!("herdless run -j 2 -- sh -c 'for j in $(seq 8); do ( {job}; true ) & done; wait'");
    let (done, max, stderr) = nested(&tree, 8, &script);
    assert_eq!(done, 8, "{stderr}");
    assert_eq!(max, 2, "the inner -j 2 rules, and is reached\n{stderr}");
}

#[test]
fn new_pool_starts_a_pool_of_its_own_and_warns() {
    let tree = JobTree::new("nested-new-pool");
    let job = format!("herdless exec sh {0}/job.sh {0}", tree.dir.display());
    let script =
        format!("herdless run -j 3 --new-pool -- sh -c 'for j in $(seq 9); do {job} & done; wait'");
    let (done, max, stderr) = nested(&tree, 1, &script);
    assert_eq!(done, 9, "{stderr}");
    assert!(max <= 3, "{stderr}");
    assert!(
        stderr.contains("warning: --new-pool: -j3 forced in a pool of its own"),
        "{stderr}"
    );
}
