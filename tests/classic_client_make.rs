//! `herdless exec` inside the recipes of real makes: GNU make 4.3 (pipe
//! style), GNU make 4.4.1 (fifo style) and bmake (`-J`). Each Makefile's
//! jobs record how many run at once; the tests assert the limit is reached
//! and never exceeded, that every token is back in the pipe at the end, and
//! that nothing deadlocks when every recipe is a `herdless exec`.
//!
//! A test that needs a program that is missing fails and says how to get
//! it; none passes without running.

mod classic_client_support;
mod common;

use std::fmt::Write as _;
use std::process::Command;

use classic_client_support::{
    assert_tokens_back, clean, herdless, serial, text, Jobs, Make, Ran, Server,
};

/// One recipe line.
enum Recipe {
    /// `herdless exec -- JOB`, marked so that make passes its jobserver
    /// (`+` for GNU make, `.MAKE` for bmake) unless `marked` is false.
    Exec { marked: bool },
    /// A shell loop that starts `n` `herdless exec` in parallel, each in a
    /// subshell that records a failure.
    Parallel { n: u32 },
    /// `herdless exec -- JOB` in a PID namespace of its own (`unshare
    /// --pid --fork`), marked: with `/proc` mounted for it or not, the
    /// namespace's first process or below a shell that is.
    InPidNamespace { mount_proc: bool, shell: bool },
}

fn makefile(make: Make, jobs: &Jobs, want: u32, targets: &[Recipe]) -> String {
    let exec = format!("{} exec -- {}", herdless(), jobs.job(want));
    let failed = jobs.path().join("failed");
    let names: Vec<String> = (1..=targets.len()).map(|i| format!("t{i}")).collect();
    let mut mk = String::new();
    writeln!(mk, ".PHONY: all {}", names.join(" ")).unwrap();
    writeln!(mk, "all: {}", names.join(" ")).unwrap();
    for (name, recipe) in names.iter().zip(targets) {
        let marked = match recipe {
            Recipe::Exec { marked } => *marked,
            Recipe::Parallel { .. } | Recipe::InPidNamespace { .. } => true,
        };
        if make == Make::Bmake && marked {
            writeln!(mk, "{name}: .MAKE").unwrap();
        } else {
            writeln!(mk, "{name}:").unwrap();
        }
        let plus = if make != Make::Bmake && marked {
            "+"
        } else {
            ""
        };
        let line = match recipe {
            Recipe::Exec { .. } => exec.clone(),
            Recipe::Parallel { n } => format!(
                "for i in {}; do ( {exec} || echo $$i >> {} ) & done; wait",
                (1..=*n)
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
                failed.display()
            ),
            Recipe::InPidNamespace { mount_proc, shell } => format!(
                "unshare --pid --fork{} {}",
                if *mount_proc { " --mount-proc" } else { "" },
                if *shell {
                    format!("sh -c '{exec}'")
                } else {
                    exec.clone()
                }
            ),
        };
        writeln!(mk, "\t{plus}{line}").unwrap();
    }
    mk
}

fn run_make(make: Make, server: Server, jobs: &Jobs, want: u32, targets: &[Recipe]) -> Ran {
    let program = make.program();
    let dir = jobs.path();
    let mf = dir.join("Makefile");
    std::fs::write(&mf, makefile(make, jobs, want, targets)).unwrap();
    let mut cmd: Command = clean(&program);
    cmd.arg("-f").arg(&mf).current_dir(dir);
    let what = format!("{make:?} ({})", program.display());
    classic_client_support::run_make(make, server, &mut cmd, dir, &what)
}

/// Every token is back in the external jobserver.
fn check_tokens_back(make: Make, left: Option<Vec<u8>>, tokens: usize) {
    let left = left.expect("an external jobserver");
    assert_tokens_back(make, &left, tokens, &format!("{make:?}"));
}

fn execs(n: usize) -> Vec<Recipe> {
    (0..n).map(|_| Recipe::Exec { marked: true }).collect()
}

/// The make succeeded, every job ran and ended, and make itself saw no
/// lost token.
fn check_ran(ran: &Ran, jobs: &Jobs, expected: usize) {
    let out = &ran.out;
    assert!(out.status.success(), "{}", text(out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("INTERNAL"), "{}", text(out));
    assert!(!stderr.contains("jobserver unavailable"), "{}", text(out));
    assert!(
        !jobs.path().join("failed").exists(),
        "a parallel herdless exec failed\n{}",
        text(out)
    );
    assert_eq!(jobs.done(), expected, "{}", text(out));
    assert_eq!(jobs.running(), 0);
}

/// Make's -j3 with herdless exec in every recipe: at most 3 at once, 3
/// reached, and the external pipe's 2 tokens back.
fn recipes_run_herdless_exec(make: Make) {
    let _serial = serial();
    let jobs = Jobs::new("recipes");
    let ran = run_make(make, Server::External { tokens: 2 }, &jobs, 3, &execs(9));
    check_ran(&ran, &jobs, 9);
    assert_eq!(
        jobs.peak(),
        3,
        "at most 3 at once, and 3 reached\n{}",
        text(&ran.out)
    );
    check_tokens_back(make, ran.left, 2);

    let jobs = Jobs::new("recipes-direct");
    let ran = run_make(make, Server::Direct { jobs: 3 }, &jobs, 3, &execs(9));
    check_ran(&ran, &jobs, 9);
    assert_eq!(jobs.peak(), 3, "{}", text(&ran.out));
}

/// One recipe starts 6 herdless exec at once: they share the recipe's
/// slot and take make's 2 spare tokens, so 3 run at once. With two such
/// recipes, make takes a token for the second, and still 3 run at once.
fn a_recipe_script_takes_makes_tokens(make: Make) {
    let _serial = serial();
    for recipes in [1, 2] {
        let jobs = Jobs::new("script");
        let targets: Vec<_> = (0..recipes).map(|_| Recipe::Parallel { n: 6 }).collect();
        let ran = run_make(make, Server::External { tokens: 2 }, &jobs, 3, &targets);
        check_ran(&ran, &jobs, 6 * recipes);
        assert_eq!(
            jobs.peak(),
            3,
            "{recipes} recipe(s): the slot(s) plus make's tokens, never more\n{}",
            text(&ran.out)
        );
        check_tokens_back(make, ran.left, 2);
    }
}

/// -j1 and -j2 where every recipe is a herdless exec (and one runs several
/// at once): everything finishes.
fn no_deadlock_at_j1_and_j2(make: Make) {
    let _serial = serial();
    for tokens in [0, 1] {
        let jobs = Jobs::new("deadlock");
        let mut targets = execs(4);
        targets.push(Recipe::Parallel { n: 3 });
        let ran = run_make(make, Server::External { tokens }, &jobs, 1, &targets);
        check_ran(&ran, &jobs, 7);
        let limit = tokens as u32 + 1;
        assert!(jobs.peak() <= limit, "-j{limit}: peak {}", jobs.peak());
        check_tokens_back(make, ran.left, tokens);
    }
    let jobs = Jobs::new("deadlock-direct");
    let mut targets = execs(4);
    targets.push(Recipe::Parallel { n: 3 });
    let ran = run_make(make, Server::Direct { jobs: 2 }, &jobs, 1, &targets);
    check_ran(&ran, &jobs, 7);
    assert!(jobs.peak() <= 2, "-j2: peak {}", jobs.peak());
}

/// `herdless exec` jobs in PID namespaces of their own, one per recipe
/// (a recipe that sandboxes its command: `unshare --pid`, `bwrap
/// --unshare-pid`), at -j 2 and 3: the job cannot see the make above it
/// (its parent reads 0, or `/proc` is another namespace's, or its tree ends
/// at the namespace's first process), and runs in the token the make took
/// for its recipe, as a stock sub-make would. Taken as orphaned, it
/// waited for a pipe token while the make held the recipe's for it, and
/// two such recipes at -j 2 waited for good. Every job runs, at most N at
/// once and N reached, every token back.
fn exec_jobs_in_pid_namespaces(make: Make) {
    if !common::pid_namespaces_allowed() {
        eprintln!("skipped: `unshare --pid --fork --mount-proc` is not allowed here");
        return;
    }
    let _serial = serial();
    let targets: Vec<Recipe> = [(false, true), (false, false), (true, true), (true, false)]
        .into_iter()
        .map(|(mount_proc, shell)| Recipe::InPidNamespace { mount_proc, shell })
        .collect();
    for tokens in [1, 2] {
        let jobs = Jobs::new("pid-namespace");
        let n = tokens as u32 + 1;
        let ran = run_make(make, Server::External { tokens }, &jobs, n, &targets);
        check_ran(&ran, &jobs, targets.len());
        assert!(jobs.peak() <= n, "-j{n}: peak {}", jobs.peak());
        assert_eq!(
            jobs.peak(),
            n,
            "-j{n}: never {n} at once\n{}",
            text(&ran.out)
        );
        check_tokens_back(make, ran.left, tokens);
    }
}

#[test]
fn gnu_make_43_pipe_exec_jobs_in_pid_namespaces() {
    exec_jobs_in_pid_namespaces(Make::Gnu43);
}

#[test]
fn gnu_make_441_fifo_exec_jobs_in_pid_namespaces() {
    exec_jobs_in_pid_namespaces(Make::Gnu441);
}

#[test]
fn bmake_exec_jobs_in_pid_namespaces() {
    exec_jobs_in_pid_namespaces(Make::Bmake);
}

#[test]
fn gnu_make_43_pipe_recipes_run_herdless_exec() {
    recipes_run_herdless_exec(Make::Gnu43);
}

#[test]
fn gnu_make_43_pipe_recipe_script_takes_makes_tokens() {
    a_recipe_script_takes_makes_tokens(Make::Gnu43);
}

#[test]
fn gnu_make_43_pipe_no_deadlock_at_j1_and_j2() {
    no_deadlock_at_j1_and_j2(Make::Gnu43);
}

#[test]
fn gnu_make_43_recipe_without_plus_is_told_why() {
    let _serial = serial();
    let jobs = Jobs::new("no-plus");
    let ran = run_make(
        Make::Gnu43,
        Server::External { tokens: 2 },
        &jobs,
        1,
        &[Recipe::Exec { marked: false }],
    );
    assert!(!ran.out.status.success(), "{}", text(&ran.out));
    let stderr = String::from_utf8_lossy(&ran.out.stderr);
    assert!(
        stderr.contains("which is not open (was the recipe not marked with + ?)"),
        "{}",
        text(&ran.out)
    );
    check_tokens_back(Make::Gnu43, ran.left, 2);
}

#[test]
fn gnu_make_441_fifo_recipes_run_herdless_exec() {
    recipes_run_herdless_exec(Make::Gnu441);
}

#[test]
fn gnu_make_441_fifo_needs_no_plus() {
    let _serial = serial();
    let jobs = Jobs::new("fifo-no-plus");
    let targets: Vec<_> = (0..6).map(|_| Recipe::Exec { marked: false }).collect();
    let ran = run_make(
        Make::Gnu441,
        Server::External { tokens: 2 },
        &jobs,
        3,
        &targets,
    );
    check_ran(&ran, &jobs, 6);
    assert_eq!(jobs.peak(), 3, "{}", text(&ran.out));
    check_tokens_back(Make::Gnu441, ran.left, 2);
}

#[test]
fn gnu_make_441_fifo_recipe_script_takes_makes_tokens() {
    a_recipe_script_takes_makes_tokens(Make::Gnu441);
}

#[test]
fn gnu_make_441_fifo_no_deadlock_at_j1_and_j2() {
    no_deadlock_at_j1_and_j2(Make::Gnu441);
}

#[test]
fn bmake_recipes_run_herdless_exec() {
    recipes_run_herdless_exec(Make::Bmake);
}

#[test]
fn bmake_recipe_script_takes_makes_tokens() {
    a_recipe_script_takes_makes_tokens(Make::Bmake);
}

#[test]
fn bmake_no_deadlock_at_j1_and_j2() {
    no_deadlock_at_j1_and_j2(Make::Bmake);
}

#[test]
fn bmake_target_without_make_attribute_is_told_why() {
    let _serial = serial();
    let jobs = Jobs::new("no-dotmake");
    let ran = run_make(
        Make::Bmake,
        Server::External { tokens: 2 },
        &jobs,
        1,
        &[Recipe::Exec { marked: false }],
    );
    assert!(!ran.out.status.success(), "{}", text(&ran.out));
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&ran.out.stdout),
        String::from_utf8_lossy(&ran.out.stderr)
    );
    assert!(
        out.contains("which is not open (is the target not marked .MAKE?)"),
        "{}",
        text(&ran.out)
    );
}

#[test]
fn a_job_of_a_job_under_a_recipe_shell_does_not_deadlock() {
    use std::os::unix::process::CommandExt;
    // The outer `herdless exec` runs under the recipe's shell and holds
    // that shell's slot; the inner one must not wait for that slot.
    let dir = std::env::temp_dir().join(format!("herdless-jobofjob-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = env!("CARGO_BIN_EXE_herdless");
    let mut mk = String::from("all: a b\n");
    for t in ["a", "b"] {
        mk += &format!("{t}:\n\t+cd . && {bin} exec sh -c '{bin} exec echo {t}'\n");
    }
    std::fs::write(dir.join("Makefile"), mk).unwrap();
    let mut child = std::process::Command::new("make")
        .args(["-s", "-j2"])
        .current_dir(&dir)
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET")
        .stdout(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            // The whole tree, so no stuck job outlives the test.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
            panic!("make -j2 deadlocked on a job of a job");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{status:?}");
}
