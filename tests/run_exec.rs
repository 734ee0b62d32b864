//! `herdless run` and `herdless exec` as a user runs them: real shells,
//! real processes, jobs that record how many of them run at once.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{path_with_bin, signal, stat, wait_timeout, JobTree, BIN, PATIENCE};

fn herdless(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("PATH", path_with_bin());
    cmd
}

fn output_within(mut cmd: Command) -> Output {
    common::output_within(&mut cmd, PATIENCE * 2)
}

#[test]
fn sixty_four_execs_under_j4_run_four_at_a_time() {
    let tree = JobTree::new("sixty-four");
    let script = format!(
        r#"for i in $(seq 64); do herdless exec sh {0}/job.sh {0} & done; wait"#,
        tree.dir.display()
    );
    let out = output_within({
        let mut c = herdless(&["run", "-j", "4", "--stats", "--", "sh", "-c", &script]);
        c.env_remove("HERDLESS_SOCKET");
        c
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, 64, "every job finished");
    assert_eq!(max, 4, "at most 4 at once, and 4 reached");
    assert_eq!(stat(&stderr, "tokens lost"), "0");
    assert_eq!(stat(&stderr, "max in use"), "4");
    // Every exec was granted exactly once.
    assert!(
        stat(&stderr, "grants").starts_with("64 to native clients"),
        "{stderr}"
    );
}

#[test]
fn nested_jobs_progress_with_zero_spare_tokens() {
    // -j 1: no shared token at all. Each exec runs in its parent's
    // implicit slot, so nesting and sequences never wait for ever.
    let out = output_within(herdless(&[
        "run",
        "-j",
        "1",
        "--",
        "sh",
        "-c",
        "herdless exec herdless exec herdless exec echo deep; \
         herdless exec false; echo after-false=$?; \
         herdless exec sh -c 'kill -KILL $$'; echo after-kill=$?; \
         herdless exec true && echo done",
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["deep", "after-false=1", "after-kill=137", "done"]
    );
}

#[test]
fn run_passes_on_the_exit_status() {
    let code = |args: &[&str]| output_within(herdless(args)).status.code();
    assert_eq!(
        code(&["run", "-j", "2", "--", "sh", "-c", "exit 7"]),
        Some(7)
    );
    assert_eq!(code(&["run", "-j", "2", "--", "true"]), Some(0));
    // As make users type it, and a command whose own options follow.
    assert_eq!(code(&["run", "-j2", "sh", "-c", "exit 6"]), Some(6));
    assert_eq!(
        code(&["run", "--jobs=2", "--", "sh", "-e", "-c", "false"]),
        Some(1)
    );
    assert_eq!(
        code(&["run", "-j", "2", "--", "sh", "-c", "kill -TERM $$"]),
        Some(143)
    );
    assert_eq!(
        code(&["run", "-j", "2", "--", "/nonexistent/command"]),
        Some(127)
    );
    assert_eq!(code(&["run", "-j", "2", "--", "/"]), Some(126));
    assert_eq!(code(&["run", "-j", "0", "--", "true"]), Some(2));
}

#[test]
fn run_exports_a_private_socket_and_removes_it() {
    let out = output_within(herdless(&[
        "run",
        "-j",
        "3",
        "--",
        "sh",
        "-c",
        r#"echo "$HERDLESS_SOCKET"; ls -ld "$(dirname "$HERDLESS_SOCKET")" | cut -c1-10; herdless status --json"#,
    ]));
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let socket = lines.next().unwrap();
    assert_eq!(
        lines.next(),
        Some("drwx------"),
        "a directory only its user can enter"
    );
    let status: herdless::status::Status = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!((status.jobs, status.capacity), (3, 2));
    // Nobody holds a token: each is free or in the classic pipe.
    let classic = status.classic.expect("a classic jobserver by default");
    assert_eq!(status.free + classic.in_pipe, 2, "{classic:?}");
    assert_eq!(classic.held, 0);
    assert!(!Path::new(socket).exists(), "socket {socket} left behind");
    assert!(!Path::new(socket).parent().unwrap().exists());
}

#[test]
fn run_forwards_signals_to_the_command() {
    for (sig, name) in [
        (libc::SIGTERM, "TERM"),
        (libc::SIGINT, "INT"),
        (libc::SIGHUP, "HUP"),
    ] {
        if common::ignored_here(sig) {
            eprintln!("SIG{name} is ignored here (nohup?): run leaves it so; not checked");
            continue;
        }
        let script = format!(
            "trap 'echo got-{name}; exit 3' {name}; echo ready; while :; do sleep 0.05; done"
        );
        let mut child = herdless(&["run", "-j", "2", "--", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        signal(child.id() as i32, sig);
        let status = wait_timeout(&mut child, PATIENCE).expect("run did not end");
        line.clear();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), format!("got-{name}"));
        assert_eq!(status.code(), Some(3), "{name}");
    }
}

#[test]
fn exec_without_a_broker_fails_at_once() {
    let out = output_within({
        let mut c = herdless(&["exec", "true"]);
        c.env_remove("HERDLESS_SOCKET")
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("CARGO_MAKEFLAGS");
        c
    });
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs a jobserver"), "{stderr}");

    let out = output_within({
        let mut c = herdless(&["exec", "true"]);
        c.env("HERDLESS_SOCKET", "/nonexistent/broker.sock");
        c
    });
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/broker.sock does not exist"),
        "{stderr}"
    );
    // The cause is said once, not once by the message and again by the
    // error chain.
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );

    // A name that is there but no socket (a regular file, a directory) is
    // said to be no socket, not a broker's stale one.
    let dir = std::env::temp_dir().join(format!("herdless-not-a-socket-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, b"").unwrap();
    for path in [&file, &dir] {
        let out = output_within({
            let mut c = herdless(&["exec", "true"]);
            c.env("HERDLESS_SOCKET", path);
            c
        });
        assert_eq!(out.status.code(), Some(125));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("{} is not a socket", path.display())),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn signals_ignored_at_start_stay_ignored() {
    // As under nohup: SIGHUP ignored when herdless starts is ignored by the
    // command too.
    let out = output_within(herdless(&[
        "run",
        "-j",
        "2",
        "--",
        "sh",
        "-c",
        r#"trap '' HUP; exec "$HERDLESS" exec sh -c 'kill -HUP $$; echo survived'"#,
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout.trim(), "survived");
}

#[test]
fn exec_dies_of_the_signal_that_killed_its_command() {
    use std::os::unix::process::ExitStatusExt;
    let serve = common::Serve::start(2);
    let mut exec = Command::new(BIN)
        .args(["exec", "--", "sleep", "30"])
        .env("HERDLESS_SOCKET", &serve.socket)
        .spawn()
        .unwrap();
    serve.wait_for("exec to hold its token", |s| s.in_use == 1);
    signal(exec.id() as i32, libc::SIGINT);
    let status = wait_timeout(&mut exec, PATIENCE).expect("exec did not end");
    // Killed by SIGINT itself, so a shell running it stops too, rather
    // than an ordinary exit status 130 that a shell would carry on after.
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    let s = serve.wait_for("the token back", |s| s.in_use == 0);
    assert_eq!(s.lost, 0);
}

/// More jobs started at once than the broker has descriptors: the soft
/// limit is 512 and the hard one too (so `run` cannot raise it), and 1200
/// execs connect at once. Those the broker cannot take yet are told it is
/// busy and connect again once running jobs have ended: every job runs,
/// none fails, and the limit holds.
#[cfg(target_os = "linux")]
#[test]
fn more_jobs_at_once_than_descriptors_all_run() {
    const JOBS: usize = 1200;
    let tree = JobTree::new("fd-limit");
    let script = format!(
        r#"for i in $(seq {JOBS}); do herdless exec sh {0}/job.sh {0} & done; wait"#,
        tree.dir.display()
    );
    let mut cmd = Command::new("prlimit");
    cmd.args(["--nofile=512:512", "--", BIN, "run", "-j", "8", "--stats"])
        .args(["--no-classic", "--", "sh", "-c", &script])
        .env("PATH", path_with_bin())
        .env("JOB_SLEEP", "0.02")
        .env_remove("HERDLESS_SOCKET");
    let out = common::output_within(&mut cmd, PATIENCE * 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // A job that fails to get its token says so on stderr.
    let failed = stderr
        .lines()
        .filter(|l| l.contains("needs a jobserver") || l.contains("cannot take a job token"))
        .count();
    assert_eq!(failed, 0, "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, JOBS, "every job ran: {stderr}");
    assert!(max <= 8, "{max} jobs at once under -j 8");
    assert_eq!(stat(&stderr, "tokens lost"), "0");
}

/// `herdless run` short of descriptors, under `ulimit -n` 5 to 24, in
/// each style: it runs its command, or it fails with 125, saying what it
/// could not do ("cannot …", never a bare "Too many open files"), and
/// leaves nothing in `TMPDIR` either way. Below 17 it used to leave its
/// directory behind at some limits (a socket bound before the event loop
/// failed, a FIFO made before the next failed) and print only the system's
/// words at others.
#[test]
fn run_short_of_descriptors_fails_cleanly_and_leaves_nothing() {
    let tree = JobTree::new("run-nofile");
    let tmp = tree.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut ran = 0;
    for style in ["pipe", "fifo"] {
        for limit in 5..=24 {
            let mut cmd = Command::new("/bin/sh");
            cmd.arg("-c")
                .arg("ulimit -n \"$0\" && exec \"$@\"")
                .arg(limit.to_string())
                .arg(BIN)
                .args(["run", "-j", "4", "--style", style, "--", "true"])
                .env("TMPDIR", &tmp)
                .env_remove("HERDLESS_SOCKET")
                .env_remove("MAKEFLAGS")
                .env_remove("XDG_RUNTIME_DIR")
                .stdin(Stdio::null());
            let out = output_within(cmd);
            let err = String::from_utf8_lossy(&out.stderr);
            let what = format!("--style {style} at ulimit -n {limit}: {err}");
            match out.status.code() {
                Some(0) => ran += 1,
                Some(125) => {
                    assert!(
                        err.lines()
                            .all(|l| !l.starts_with("herdless: ")
                                || l.starts_with("herdless: cannot ")),
                        "{what}"
                    )
                }
                other => panic!("status {other:?}, {what}"),
            }
            let left: Vec<_> = std::fs::read_dir(&tmp)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(left.is_empty(), "{what}: left {left:?}");
        }
    }
    assert!(ran > 0, "run never ran its command under ulimit -n 24");
}
