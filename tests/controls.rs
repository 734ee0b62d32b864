//! `herdless ctl` (jobs, cap, abort), admission by load and memory, the
//! OpenMetrics status and socket activation, with real processes.
//!
//! Load and memory are faked through the broker's test hook
//! (`HERDLESS_TEST_SYSTEM` names a file of `load X` and `memory BYTES`
//! lines) rather than by loading the machine. The OpenMetrics text is read
//! by `prometheus_client`'s parser and the socket is passed by a Python
//! process that execs `herdless serve`, as systemd does; both come from
//! the venv that `bash ci/test` installs.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::{path_with_bin, stat, venv_bin, Helper, Serve, BIN, PATIENCE};
use herdless::client::Client;
use herdless::status::Status;

/// A job that records, besides the usual counts, how many ran at once
/// among the jobs that started after `DIR/shrunk` appeared.
const JOB_SH: &str = r#"#!/bin/sh
dir=$1
mkdir "$dir/running/$$"
set -- "$dir"/running/*
if [ -e "$dir/shrunk" ]; then echo "$#" >> "$dir/after"; fi
echo "$#" >> "$dir/peaks"
sleep ${JOB_SLEEP:-0.2}
rmdir "$dir/running/$$"
echo x >> "$dir/done"
"#;

struct Tree {
    dir: PathBuf,
}

impl Tree {
    fn new(name: &str) -> Tree {
        let dir = std::env::temp_dir().join(format!("herdless-ctl-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("running")).unwrap();
        fs::write(dir.join("job.sh"), JOB_SH).unwrap();
        Tree { dir }
    }
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    fn numbers(&self, name: &str) -> Vec<u32> {
        fs::read_to_string(self.path(name))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
    fn done(&self) -> usize {
        self.numbers_raw("done")
    }
    fn numbers_raw(&self, name: &str) -> usize {
        fs::read_to_string(self.path(name))
            .unwrap_or_default()
            .lines()
            .count()
    }
    /// Waits for a file a job writes; its contents.
    fn wait_file(&self, name: &str) -> String {
        let start = Instant::now();
        loop {
            if let Ok(s) = fs::read_to_string(self.path(name)) {
                if s.ends_with('\n') {
                    return s.trim().to_string();
                }
            }
            assert!(start.elapsed() < PATIENCE, "{name} never appeared");
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn status_of(socket: &Path) -> Status {
    let json = Client::observe(socket).unwrap().json().unwrap();
    serde_json::from_str(&json).unwrap()
}

fn wait_status(socket: &Path, what: &str, pred: impl Fn(&Status) -> bool) -> Status {
    let start = Instant::now();
    loop {
        let s = status_of(socket);
        if pred(&s) {
            return s;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "timed out waiting for {what}; last status: {s:#?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn ctl(socket: &Path, args: &[&str]) -> Output {
    common::output_within(
        Command::new(BIN)
            .arg("ctl")
            .arg("--socket")
            .arg(socket)
            .args(args),
        PATIENCE,
    )
}

fn ctl_ok(socket: &Path, args: &[&str]) {
    let out = ctl(socket, args);
    assert!(
        out.status.success(),
        "herdless ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn controls(s: &Status) -> &herdless::status::ControlsStatus {
    s.controls.as_ref().expect("a broker with controls")
}

/// `herdless run -j 6` of 30 jobs; once 6 run, `ctl jobs 2`. Every job
/// still ends (none is killed), and from the moment the extra tokens are
/// back, at most 2 run at once.
fn shrink_under_load(tree: &Tree, command: &[&str]) {
    let mut child = Command::new(BIN)
        .args(["run", "-j", "6", "--stats", "--"])
        .args(command)
        .current_dir(&tree.dir)
        .env("PATH", path_with_bin())
        .env("JOB_SLEEP", "0.3")
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .env_remove("HERDLESS_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let socket = PathBuf::from(tree.wait_file("socket"));
    // Under load: wait until the pool is full.
    let start = Instant::now();
    while tree.numbers("peaks").into_iter().max().unwrap_or(0) < 6 {
        assert!(start.elapsed() < PATIENCE, "the build never reached -j 6");
        thread::sleep(Duration::from_millis(5));
    }
    ctl_ok(&socket, &["jobs", "2"]);
    let s = status_of(&socket);
    assert_eq!(s.jobs, 2);
    wait_status(&socket, "the shrink's tokens back", |s| {
        controls(s).retiring == 0
    });
    fs::write(tree.path("shrunk"), "").unwrap();
    assert!(
        common::wait_timeout(&mut child, PATIENCE * 4).is_some(),
        "the build did not finish"
    );
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(tree.done(), 30, "every job ran to its end\n{stderr}");
    let after = tree.numbers("after");
    assert!(
        !after.is_empty(),
        "jobs started after the shrink completed\n{stderr}"
    );
    assert!(
        after.iter().all(|&n| n <= 2),
        "at most 2 at once after the shrink: {after:?}\n{stderr}"
    );
    assert!(
        tree.numbers("peaks").into_iter().max() == Some(6),
        "6 at once before it"
    );
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[test]
fn a_shrink_under_load_of_native_jobs_never_exceeds_the_new_n() {
    let tree = Tree::new("shrink-native");
    let d = tree.dir.display();
    let script = format!(
        "echo \"$HERDLESS_SOCKET\" > {d}/socket; \
         for i in $(seq 30); do herdless exec sh {d}/job.sh {d} & done; wait"
    );
    shrink_under_load(&tree, &["sh", "-c", &script]);
}

#[test]
fn a_shrink_under_load_of_make_jobs_never_exceeds_the_new_n() {
    common::require("make");
    let tree = Tree::new("shrink-make");
    let d = tree.dir.display();
    let jobs: Vec<String> = (1..=30).map(|i| format!("j{i}")).collect();
    let mut mk = format!("all: {}\n", jobs.join(" "));
    for j in &jobs {
        mk += &format!("{j}: sock\n\t@sh {d}/job.sh {d}\n");
    }
    mk += &format!("sock:\n\t@echo \"$$HERDLESS_SOCKET\" > {d}/socket\n");
    fs::write(tree.path("Makefile"), mk).unwrap();
    shrink_under_load(&tree, &["make", "-s"]);
}

#[test]
fn a_shrink_takes_no_token_from_a_holder_and_a_grow_grants_at_once() {
    let serve = Serve::start(5); // 4 shared tokens
    let mut holders: Vec<Helper> = (0..4)
        .map(|_| Helper::spawn(&serve.socket, "hold", 1))
        .collect();
    for h in &mut holders {
        assert_eq!(h.line(), "held 1");
    }
    let mut waiter = Helper::spawn(&serve.socket, "acquire", 1);
    assert_eq!(waiter.line(), "waiting");
    serve.wait_for("the waiter queued", |s| s.waiting == 1);
    ctl_ok(&serve.socket, &["jobs", "2"]); // 1 shared token
    let s = status_of(&serve.socket);
    assert_eq!((s.jobs, s.capacity, controls(&s).retiring), (2, 1, 3));
    assert_eq!(s.in_use, 4, "every holder keeps its token");
    // Three come back and retire; the waiter is still not served.
    for h in holders.drain(..3) {
        assert!(h.finish().success());
    }
    let s = wait_status(&serve.socket, "three retired", |s| {
        controls(s).retiring == 0
    });
    assert_eq!((s.in_use, s.waiting, s.free), (1, 1, 0), "{s:#?}");
    // The last one goes to the waiter.
    assert!(holders.pop().unwrap().finish().success());
    assert_eq!(waiter.line(), "got");
    // Grow: new tokens go to waiters at once.
    let mut more: Vec<Helper> = (0..3)
        .map(|_| Helper::spawn(&serve.socket, "acquire", 1))
        .collect();
    for h in &mut more {
        assert_eq!(h.line(), "waiting");
    }
    serve.wait_for("three waiting", |s| s.waiting == 3);
    ctl_ok(&serve.socket, &["jobs", "5"]);
    for h in &mut more {
        assert_eq!(h.line(), "got");
    }
    let s = status_of(&serve.socket);
    assert_eq!((s.in_use, s.free, s.lost), (4, 0, 0));
    drop(more);
    drop(waiter);
    let (code, _) = serve.stop();
    assert!(code.success());
}

/// `herdless run -j 4` under a classic jobserver of 5 bytes borrows its
/// shared tokens from it. Two jobs hold borrowed tokens; `ctl jobs 1`
/// retires both, `ctl jobs 4` calls that off. One job ends (its byte goes
/// back), and a third is served at once from a byte of the outer pipe,
/// though the other still holds its token.
#[test]
fn a_grow_in_a_borrowing_pool_calls_off_a_pending_shrink() {
    use std::io::Read;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::process::CommandExt;
    let tree = Tree::new("borrow-regrow");
    let (read, write) = nix::unistd::pipe().unwrap();
    nix::unistd::write(&write, b"+++++").unwrap();
    let in_pipe = || herdless_platform::bytes_readable(read.as_fd()).unwrap();
    // Waits until the outer pipe holds `n` bytes; the status read after.
    let pipe_at = |socket: &Path, n: usize, what: &str| {
        let start = Instant::now();
        while in_pipe() != n {
            assert!(
                start.elapsed() < PATIENCE,
                "timed out waiting for {what}: {} bytes in the outer pipe; last status: {:#?}",
                in_pipe(),
                status_of(socket)
            );
            thread::sleep(Duration::from_millis(10));
        }
        status_of(socket)
    };
    let mut run = Command::new(BIN)
        .args(["run", "-j", "4", "--", "sh", "-c"])
        .arg(format!(
            "echo \"$HERDLESS_SOCKET\" > {}/socket; read x; exit 0",
            tree.dir.display()
        ))
        .env(
            "MAKEFLAGS",
            format!(
                " -j6 --jobserver-auth={},{}",
                read.as_raw_fd(),
                write.as_raw_fd()
            ),
        )
        .env_remove("MFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .env_remove("HERDLESS_SOCKET")
        .env_remove("HERDLESS_SLOT")
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The whole group goes when the test ends, whatever it asserted.
    let _group = common::KillGroupOnDrop(run.id() as i32);
    let socket = PathBuf::from(tree.wait_file("socket"));
    let mut a = Helper::spawn(&socket, "hold", 1);
    assert_eq!(a.line(), "held 1");
    let mut b = Helper::spawn(&socket, "hold", 1);
    assert_eq!(b.line(), "held 1");
    let s = pipe_at(&socket, 3, "two bytes borrowed");
    assert_eq!((s.capacity, s.waiting), (2, 0), "{s:#?}");
    ctl_ok(&socket, &["jobs", "1"]);
    let s = status_of(&socket);
    assert_eq!((s.capacity, controls(&s).retiring), (0, 2), "{s:#?}");
    ctl_ok(&socket, &["jobs", "4"]);
    assert!(a.finish().success());
    pipe_at(&socket, 4, "a's byte back");
    let mut c = Helper::spawn(&socket, "acquire", 1);
    assert_eq!(c.line(), "waiting");
    let s = pipe_at(&socket, 3, "a byte borrowed for the third job");
    assert_eq!(
        (s.jobs, s.capacity, controls(&s).retiring, s.waiting),
        (4, 2, 0, 0),
        "{s:#?}"
    );
    assert_eq!(c.line(), "got");
    assert!(b.finish().success());
    assert!(c.finish().success());
    drop(run.stdin.take());
    let status = common::wait_timeout(&mut run, PATIENCE).expect("herdless run ended");
    let mut stderr = String::new();
    let _ = run.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(status.success(), "{stderr}");
    assert_eq!(in_pipe(), 5, "every borrowed byte is back\n{stderr}");
}

#[test]
fn ctl_rejects_a_jobs_figure_of_zero_and_an_unknown_broker() {
    let serve = Serve::start(3);
    let out = ctl(&serve.socket, &["jobs", "0"]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let out = ctl(Path::new("/nonexistent/herdless.sock"), &["jobs", "2"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    assert_eq!(status_of(&serve.socket).jobs, 3);
}

/// Two groups of 10 jobs start together under `serve -j 9`; one group's
/// shell (and so every job below it, two levels down) is capped at 3.
#[test]
fn a_cap_holds_for_a_clients_subtree() {
    let serve = Serve::start(9);
    let capped = Tree::new("cap-capped");
    let free = Tree::new("cap-free");
    let group = |tree: &Tree, go: &Path| {
        let d = tree.dir.display();
        let script = format!(
            "echo $$ > {d}/pid; while [ ! -e {go} ]; do sleep 0.02; done; \
             sh -c 'for i in $(seq 10); do herdless exec sh {d}/job.sh {d} & done; wait'",
            go = go.display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .env("PATH", path_with_bin())
            .env("HERDLESS_SOCKET", &serve.socket)
            .env("JOB_SLEEP", "0.4")
            .spawn()
            .unwrap()
    };
    let go = capped.path("go");
    let mut a = group(&capped, &go);
    let mut b = group(&free, &go);
    let pid = capped.wait_file("pid");
    ctl_ok(&serve.socket, &["cap", &pid, "3"]);
    let s = status_of(&serve.socket);
    assert_eq!(controls(&s).caps.len(), 1);
    fs::write(&go, "").unwrap();
    for child in [&mut a, &mut b] {
        let status = common::wait_timeout(child, PATIENCE * 2).expect("group finished");
        assert!(status.success());
    }
    assert_eq!((capped.done(), free.done()), (10, 10));
    let capped_max = capped.numbers("peaks").into_iter().max().unwrap();
    let free_max = free.numbers("peaks").into_iter().max().unwrap();
    assert_eq!(
        capped_max, 3,
        "the capped subtree: at most 3, and 3 reached"
    );
    assert!(
        free_max > 3,
        "the other subtree is not capped: {free_max} at once"
    );
    let (code, err) = serve.stop();
    assert!(code.success(), "{err}");
}

#[test]
fn ctl_abort_ends_every_wait() {
    let serve = Serve::start(2);
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiters: Vec<Helper> = (0..3)
        .map(|_| Helper::spawn(&serve.socket, "acquire-report", 1))
        .collect();
    for w in &mut waiters {
        assert_eq!(w.line(), "waiting");
    }
    serve.wait_for("three waiting", |s| s.waiting == 3);
    ctl_ok(&serve.socket, &["abort"]);
    for w in &mut waiters {
        assert_eq!(w.line(), "error Aborted(Interrupt)");
    }
    let s = status_of(&serve.socket);
    assert_eq!(s.aborted.as_deref(), Some("I"));
    drop(holder);
    let (_, err) = serve.stop();
    assert!(err.contains("aborted the tree"), "{err}");
}

/// `serve` with a limit, reading the machine's figures from a file.
fn serve_with_hook(jobs: u32, limit: &[&str], hook: &Path) -> Serve {
    Serve::start_with(jobs, |cmd| {
        cmd.args(limit).env("HERDLESS_TEST_SYSTEM", hook);
    })
}

/// Four waiters under a limit that is crossed: only the floor runs. When
/// the figure comes back under the limit nobody releases anything, so the
/// broker's own slow re-check must open admission.
fn admission(name: &str, limit: &[&str], crossed: &str, fine: &str) {
    let tree = Tree::new(name);
    let hook = tree.path("system");
    fs::write(&hook, crossed).unwrap();
    // -j 6: 5 shared tokens; --min-jobs 3: 2 of them whatever the load.
    let mut args = limit.to_vec();
    args.extend(["--min-jobs", "3"]);
    let serve = serve_with_hook(6, &args, &hook);
    let waiters: Vec<Helper> = (0..4)
        .map(|_| Helper::spawn(&serve.socket, "acquire", 1))
        .collect();
    let s = serve.wait_for("four acquires in", |s| s.in_use + s.waiting == 4);
    assert_eq!(
        (s.in_use, s.waiting, s.free),
        (2, 2, 3),
        "the floor: {s:#?}"
    );
    let c = controls(&s);
    assert_ne!(c.admission, "open");
    assert_eq!(c.held_back, 1);
    // Nothing changes while the limit holds, whatever the waiters do.
    thread::sleep(Duration::from_millis(1500));
    let s = status_of(&serve.socket);
    assert_eq!((s.in_use, s.waiting), (2, 2), "still the floor: {s:#?}");
    // From here on the test does not touch the broker until every waiter
    // says it got its token: no event wakes the broker, only its timer.
    fs::write(&hook, fine).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for mut w in waiters {
        let tx = tx.clone();
        thread::spawn(move || loop {
            let line = w.line();
            if line == "got" || line.is_empty() {
                let _ = tx.send((line, w));
                return;
            }
        });
    }
    let waiters: Vec<Helper> = (0..4)
        .map(|_| {
            let (line, w) = rx
                .recv_timeout(PATIENCE)
                .expect("the broker re-checked the limit on its own");
            assert_eq!(line, "got");
            w
        })
        .collect();
    let s = status_of(&serve.socket);
    assert_eq!((s.in_use, s.waiting), (4, 0));
    assert_eq!(controls(&s).admission, "open");
    drop(waiters);
    let (code, _) = serve.stop();
    assert!(code.success());
}

#[test]
fn load_admission_holds_grants_down_to_the_floor_and_reopens_on_its_own() {
    admission("load", &["--max-load", "4"], "load 9.5\n", "load 0.5\n");
}

#[test]
fn memory_admission_holds_grants_down_to_the_floor_and_reopens_on_its_own() {
    admission(
        "memory",
        &["--min-free-memory", "1G"],
        "memory 1048576\n",
        "memory 4294967296\n",
    );
}

/// `herdless run` with a load limit that holds all along: make, through
/// the classic pipe, runs at the floor (`--min-jobs 2`: its own job and
/// one token) and finishes.
#[test]
fn a_make_build_under_a_held_load_limit_runs_at_the_floor() {
    common::require("make");
    let tree = Tree::new("floor-make");
    let hook = tree.path("system");
    fs::write(&hook, "load 50\n").unwrap();
    let d = tree.dir.display();
    let jobs: Vec<String> = (1..=12).map(|i| format!("j{i}")).collect();
    let mut mk = format!("all: {}\n", jobs.join(" "));
    for j in &jobs {
        mk += &format!("{j}:\n\t@sh {d}/job.sh {d}\n");
    }
    fs::write(tree.path("Makefile"), mk).unwrap();
    let out = common::output_within(
        Command::new(BIN)
            .args(["run", "-j", "5", "--max-load", "2", "--min-jobs", "2"])
            .args(["--stats", "--", "make", "-s"])
            .current_dir(&tree.dir)
            .env("PATH", path_with_bin())
            .env("HERDLESS_TEST_SYSTEM", &hook)
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("CARGO_MAKEFLAGS")
            .env_remove("MAKELEVEL")
            .env_remove("HERDLESS_SOCKET"),
        PATIENCE * 2,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(tree.done(), 12, "every job ran\n{stderr}");
    let max = tree.numbers("peaks").into_iter().max().unwrap_or(0);
    assert_eq!(max, 2, "the floor: 2 at once, and 2 reached\n{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[test]
fn openmetrics_status_parses_with_prometheus_client() {
    let python = venv_bin("python");
    let serve = Serve::start(2);
    // Some waits, so the histogram has samples.
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiter = Helper::spawn(&serve.socket, "acquire", 1);
    assert_eq!(waiter.line(), "waiting");
    serve.wait_for("one waiting", |s| s.waiting == 1);
    assert!(holder.finish().success());
    assert_eq!(waiter.line(), "got");
    ctl_ok(&serve.socket, &["cap", "1", "5"]);
    let out = common::output_within(
        Command::new(BIN)
            .args(["status", "--format", "openmetrics", "--socket"])
            .arg(&serve.socket),
        PATIENCE,
    );
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let parser = r#"
import sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
for f in text_string_to_metric_families(sys.stdin.read()):
    for s in f.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        print(f.type, f.unit or "-", s.name, labels or "-", s.value)
"#;
    let mut child = Command::new(&python)
        .args(["-c", parser])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let parsed = child.wait_with_output().unwrap();
    let listing = String::from_utf8_lossy(&parsed.stdout);
    assert!(
        parsed.status.success(),
        "prometheus_client rejects the exposition:\n{}\n{text}",
        String::from_utf8_lossy(&parsed.stderr)
    );
    let value = |name: &str, labels: &str| -> f64 {
        listing
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f[2] == name && f[3] == labels).then(|| f[4].parse().unwrap())
            })
            .unwrap_or_else(|| panic!("no {name} {labels} in:\n{listing}"))
    };
    let s = status_of(&serve.socket);
    assert_eq!(value("herdless_grants_total", "-"), s.grants as f64);
    assert_eq!(value("herdless_waits_total", "-"), 1.0);
    assert_eq!(value("herdless_wakeups_total", "-"), s.wakeups as f64);
    if cfg!(target_os = "linux") {
        // The broker's thread slept at least while the waiter waited; the
        // status read after the exposition counts as many or more.
        let woke = value("herdless_broker_wakeups_total", "-");
        let later = s.broker_vcsw.expect("counted per thread on Linux") as f64;
        assert!(woke >= 1.0 && woke <= later, "{woke} then {later}");
    }
    assert_eq!(value("herdless_tokens_in_use", "-"), s.in_use as f64);
    assert_eq!(value("herdless_tokens_lost", "-"), 0.0);
    assert_eq!(
        value("herdless_tokens_reclaimed_total", "-"),
        s.reclaimed as f64
    );
    assert_eq!(value("herdless_wait_seconds_count", "-"), 1.0);
    assert_eq!(value("herdless_wait_seconds_bucket", "le=+Inf"), 1.0);
    assert!(value("herdless_wait_seconds_sum", "-") > 0.0);
    assert_eq!(value("herdless_cap_tokens", "pid=1"), 5.0);
    assert!(
        listing.contains("histogram seconds herdless_wait_seconds_bucket"),
        "{listing}"
    );
    drop(waiter);
    let (code, _) = serve.stop();
    assert!(code.success());
}

/// systemd's way: the manager binds and listens, then starts the service
/// with the socket as descriptor 3, `LISTEN_FDS=1` and `LISTEN_PID` its
/// own pid. A Python process does the same and execs `herdless serve`.
#[test]
fn serve_takes_the_socket_passed_by_socket_activation() {
    let python = venv_bin("python");
    let tree = Tree::new("activation");
    let socket = tree.path("herdless.sock");
    let activate = r#"
import os, socket, sys
path, herdless = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(64)
if s.fileno() != 3:
    os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(herdless, [herdless, "serve", "-j", "3"])
"#;
    let mut child = Command::new(&python)
        .args(["-c", activate])
        .arg(&socket)
        .arg(BIN)
        .env("HERDLESS_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(
        line.trim().starts_with(&format!(
            "export HERDLESS_SOCKET={} HERDLESS_SLOT=",
            socket.display()
        )),
        "{line}"
    );
    // Clients of the passed socket are served, tokens held and counted.
    let mut holder = Helper::spawn(&socket, "hold", 2);
    assert_eq!(holder.line(), "held 2");
    let s = status_of(&socket);
    assert_eq!((s.jobs, s.in_use, s.free), (3, 2, 0));
    assert!(holder.finish().success());
    // The children of the broker do not see the activation variables.
    common::signal(child.id() as i32, libc::SIGTERM);
    let status = common::wait_timeout(&mut child, PATIENCE).expect("serve stops on SIGTERM");
    assert!(status.success());
}

#[test]
fn a_version_1_connection_cannot_send_control() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let serve = Serve::start(3);
    let mut s = UnixStream::connect(&serve.socket).unwrap();
    // A version 1 hello (pid, ppid) by hand: refused by its version before
    // the control request is read.
    let mut frames = vec![
        0x0f, 0, 0, 0, 0x01, b'H', b'R', b'D', b'L', 1, 0, 0x02, 0x92, 0x10, 0, 0, 0x01, 0, 0, 0,
    ];
    herdless::protocol::Request::Control(herdless::protocol::ControlOp::SetJobs(1))
        .encode(&mut frames);
    s.write_all(&frames).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    let (error, _) = herdless::protocol::decode_reply(&got).unwrap().unwrap();
    let herdless::protocol::Reply::Error { message } = error else {
        panic!("expected an error, got {error:?}");
    };
    assert!(
        message.starts_with("unsupported protocol version 1 (broker speaks 3 to 5)"),
        "{message}"
    );
    assert_eq!(status_of(&serve.socket).jobs, 3, "nothing changed");
}

#[test]
fn helper_process() {
    common::helper_main();
}
