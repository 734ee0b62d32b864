//! Shared pieces of the integration tests: a broker in its own process,
//! client processes that act out a role, and status polling.
//!
//! Client processes are this very test binary, run again with
//! `HERDLESS_TEST_ROLE` set: its `helper_process` test then plays the role
//! with the real client library and exits, so each client is a separate
//! process with its own connection, as in a real build.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use herdless::client::{Client, Options};
use herdless::status::Status;

pub const BIN: &str = env!("CARGO_BIN_EXE_herdless");

/// A liveness bound for things that must happen "promptly": generous, so
/// a loaded machine does not fail a test, but finite, so a hang does.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// PATH with the herdless binary's directory first.
pub fn path_with_bin() -> std::ffi::OsString {
    let dir = Path::new(BIN).parent().unwrap();
    let mut paths = vec![dir.to_path_buf()];
    paths.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(paths).unwrap()
}

/// A `herdless serve` process.
pub struct Serve {
    pub child: Child,
    pub socket: PathBuf,
    stderr: Option<thread::JoinHandle<String>>,
}

impl Serve {
    pub fn start(jobs: u32) -> Serve {
        Serve::start_with(jobs, |_| {})
    }

    pub fn start_with(jobs: u32, tweak: impl FnOnce(&mut Command)) -> Serve {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "-j", &jobs.to_string()])
            .env("HERDLESS_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        tweak(&mut cmd);
        let mut child = cmd.spawn().expect("spawn herdless serve");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).expect("read the export line");
        let socket = line
            .trim()
            .strip_prefix("export HERDLESS_SOCKET=")
            .unwrap_or_else(|| panic!("unexpected first line from serve: {line:?}"))
            .split(' ')
            .next()
            .unwrap()
            .trim_matches('\'')
            .into();
        let mut err = child.stderr.take().unwrap();
        let stderr = thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Serve {
            child,
            socket,
            stderr: Some(stderr),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn status(&self) -> Status {
        let json = Client::observe(&self.socket)
            .expect("observe")
            .json()
            .expect("status");
        serde_json::from_str(&json).expect("status json")
    }

    /// Polls status until `pred` holds; panics after PATIENCE.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&Status) -> bool) -> Status {
        let start = Instant::now();
        loop {
            let s = self.status();
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

    /// Stops the broker with SIGTERM; returns its exit status and stderr.
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        signal(self.pid(), libc::SIGTERM);
        let status =
            wait_timeout(&mut self.child, PATIENCE).expect("serve did not stop on SIGTERM");
        let err = self.stderr.take().unwrap().join().unwrap();
        (status, err)
    }

    /// Kills the broker with SIGKILL and reaps it.
    pub fn kill(mut self) -> String {
        signal(self.pid(), libc::SIGKILL);
        let _ = self.child.wait();
        self.stderr.take().unwrap().join().unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.stderr.is_some() {
            signal(self.pid(), libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

pub fn signal(pid: i32, sig: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::try_from(sig).unwrap(),
    );
}

/// What every process of group `pgid` is doing, for a test that found
/// it stuck: each process's command line, and each thread's state, wait
/// channel and kernel stack from /proc (the stack where /proc shows it,
/// as to root), then the threads' user-space backtraces where `gdb` is
/// installed. Linux only; elsewhere it says so.
pub fn group_report(pgid: i32) -> String {
    let mut out = String::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return "no /proc to read the group from".into();
    };
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default();
    // (pid, parent) of each process in the group.
    let mut pids: Vec<(i32, String)> = procs
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = read(format!("/proc/{pid}/stat"));
            // pid (comm) state ppid pgrp ...: comm may hold spaces.
            let mut after = stat.rsplit_once(')')?.1.split_whitespace().skip(1);
            let ppid = after.next()?.to_owned();
            (after.next()? == pgid.to_string()).then_some((pid, ppid))
        })
        .collect();
    pids.sort_unstable();
    for (pid, ppid) in &pids {
        let cmdline = read(format!("/proc/{pid}/cmdline")).replace('\0', " ");
        out += &format!("process {pid} (parent {ppid}): {}\n", cmdline.trim());
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok());
        for tid in tasks {
            let dir = format!("/proc/{pid}/task/{tid}");
            let state = read(format!("{dir}/status"))
                .lines()
                .find_map(|l| l.strip_prefix("State:").map(|s| s.trim().to_owned()))
                .unwrap_or_default();
            out += &format!(
                "  thread {tid} {}: {state}, waits in {}\n",
                read(format!("{dir}/comm")).trim(),
                read(format!("{dir}/wchan")).trim()
            );
            for frame in read(format!("{dir}/stack")).lines() {
                out += &format!("    {frame}\n");
            }
        }
    }
    if pids.is_empty() {
        out += &format!("no process is left in group {pgid}\n");
    }
    for (pid, _) in &pids {
        let gdb = Command::new("gdb")
            .args([
                "-p",
                &pid.to_string(),
                "-batch",
                "-ex",
                "thread apply all bt",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut gdb) = gdb else {
            out += "(no gdb here for user-space backtraces)\n";
            break;
        };
        // gdb waits for good on a process that is stopped (SIGSTOP) or
        // in an uninterruptible sleep: give up on that one.
        if wait_timeout(&mut gdb, Duration::from_secs(10)).is_none() {
            let _ = gdb.kill();
            let _ = gdb.wait();
            out += &format!("(gdb could not attach to {pid} within 10 s)\n");
            continue;
        }
        let mut text = String::new();
        if let Some(mut stdout) = gdb.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        }
        out += &format!("gdb backtraces of {pid}:\n");
        for line in text.lines() {
            if line.starts_with('#') || line.starts_with("Thread") {
                out += &format!("  {line}\n");
            }
        }
    }
    out
}

/// Waits up to `patience` for `child`, the leader of its own process
/// group, and returns its status; when it has not ended, panics with
/// `what` and the [`group_report`] of its group, killed first.
pub fn wait_or_report(child: &mut Child, patience: Duration, what: &str) -> ExitStatus {
    if let Some(status) = wait_timeout(child, patience) {
        return status;
    }
    let pgid = child.id() as i32;
    let report = group_report(pgid);
    signal(-pgid, libc::SIGKILL);
    let _ = child.wait();
    panic!("{what}; what was left:\n{report}");
}

/// Polls `ready` every 10 ms until it holds; after `patience`, panics
/// with `what` and the [`group_report`] of process group `pgid`, killed
/// first.
pub fn until_or_report(pgid: i32, patience: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        if start.elapsed() > patience {
            let report = group_report(pgid);
            signal(-pgid, libc::SIGKILL);
            panic!("{what}; what was left:\n{report}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether this test process started with `sig` ignored, as everything
/// under `nohup` starts with SIGHUP: `herdless run` then leaves it ignored
/// (its command inherits that), by design, so a test that sends it to
/// `run` has nothing to check. Read from `/proc/self/status`; false where
/// there is none.
pub fn ignored_here(sig: i32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| sig >= 1 && mask & (1 << (sig - 1)) != 0)
}

/// Waits for a child with a bound; None when it is still running.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if start.elapsed() > limit {
            return None;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `cmd` with its output captured; panics, killing it, if it has not
/// finished within `limit`. The output is read while it runs: a command
/// that writes more than a pipe holds would otherwise wait for good.
pub fn output_within(cmd: &mut Command, limit: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let Some(status) = wait_timeout(&mut child, limit) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("command did not finish within {limit:?}: {cmd:?}");
    };
    // Descendants that outlive the command may hold the pipes open: the
    // output is what came until they close them.
    std::process::Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

/// This test binary, run again to play a role: only its `helper_process`
/// test runs, and prints what it says.
pub fn helper_command() -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "helper_process",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// A client process playing a role (see `helper_main`).
pub struct Helper {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub stdout: BufReader<ChildStdout>,
}

impl Helper {
    /// Starts this test binary as a client process of `socket`.
    pub fn spawn(socket: &Path, role: &str, count: u32) -> Helper {
        Helper::spawn_with(socket, role, count, &[])
    }

    /// [`Helper::spawn`] with more environment variables.
    #[allow(dead_code)]
    pub fn spawn_with(socket: &Path, role: &str, count: u32, env: &[(&str, &str)]) -> Helper {
        let mut child = helper_command()
            .env("HERDLESS_TEST_ROLE", role)
            .env("HERDLESS_TEST_COUNT", count.to_string())
            .env("HERDLESS_SOCKET", socket)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn helper");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Helper {
            child,
            stdin,
            stdout,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line the role printed (with libtest's noise skipped).
    pub fn line(&mut self) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("read helper");
            if n == 0 {
                return String::new();
            }
            if let Some(at) = line.find("role: ") {
                return line[at + 6..].trim().to_string();
            }
        }
    }

    /// Closes stdin: the role gives back what it holds and exits.
    pub fn finish(mut self) -> std::process::ExitStatus {
        drop(self.stdin.take());
        wait_timeout(&mut self.child, PATIENCE).expect("helper did not exit")
    }

    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn say(msg: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "role: {msg}").unwrap();
    out.flush().unwrap();
}

fn wait_stdin_eof() {
    let mut buf = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut buf);
}

/// The body of every test binary's `helper_process` test. Returns at once
/// when the binary runs as a test rather than as a helper.
///
/// Roles (shared tokens only, never the implicit one):
/// - `hold`: take `HERDLESS_TEST_COUNT` tokens, say `held N`, keep them
///   until stdin closes, then give them back;
/// - `acquire`: say `waiting`, take one token, say `got`, keep it until
///   stdin closes;
/// - `acquire-report`: take one token and say `got`, or say `error KIND`.
pub fn helper_main() {
    let Ok(role) = std::env::var("HERDLESS_TEST_ROLE") else {
        return;
    };
    let count: u32 = std::env::var("HERDLESS_TEST_COUNT")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1);
    if role == "raw-hello" {
        // A hello on a raw socket, bypassing the client's own checks, to
        // see what the broker itself answers.
        let path = std::env::var_os("HERDLESS_SOCKET").unwrap();
        let mut s = std::os::unix::net::UnixStream::connect(path).expect("connect");
        let mut hello = Vec::new();
        herdless::protocol::Request::Hello {
            version: herdless::protocol::PROTOCOL_VERSION,
            flags: herdless::protocol::HelloFlags::empty(),
            pid: std::process::id(),
            slot: 0,
        }
        .encode(&mut hello);
        // The broker may refuse and close before the hello is written.
        let _ = s.write_all(&hello);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        match herdless::protocol::decode_reply(&got) {
            Ok(Some((reply, _))) => say(format!("{reply:?}")),
            other => say(format!("undecodable answer {other:?}")),
        }
        std::process::exit(0);
    }
    let client = match Client::from_env_with(Options::default().implicit_token(false)) {
        Ok(c) => c,
        Err(e) => {
            say(format!("error {:?} {e}", e.kind()));
            std::process::exit(3);
        }
    };
    match role.as_str() {
        "hold" => {
            let tokens: Vec<_> = (0..count)
                .map(|_| client.acquire().expect("acquire"))
                .collect();
            say(format!("held {}", tokens.len()));
            wait_stdin_eof();
            drop(tokens);
        }
        "acquire" => {
            say("waiting");
            let t = client.acquire().expect("acquire");
            say("got");
            wait_stdin_eof();
            drop(t);
        }
        "acquire-report" => {
            say("waiting");
            match client.acquire() {
                Ok(t) => {
                    say("got");
                    wait_stdin_eof();
                    drop(t);
                }
                Err(e) => {
                    say(format!("error {:?}", e.kind()));
                    std::process::exit(4);
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

/// Whether this machine lets a process start a PID namespace of its own
/// (`unshare --pid --fork --mount-proc`: root, or a container that allows
/// it).
pub fn pid_namespaces_allowed() -> bool {
    std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The job every Makefile runs: registers itself, records how many jobs
/// run at once, works a little, unregisters, counts itself done. The counts
/// only ever under-estimate concurrency, so "at most N" is exact. Each
/// registers under a name of its own (`mktemp`), not its process id: jobs
/// in PID namespaces of their own may share one.
pub const JOB_SH: &str = r#"#!/bin/sh
dir=$1
me=$(mktemp -d "$dir/running/job.XXXXXXXX") || exit 1
set -- "$dir"/running/*
echo "$#" >> "$dir/peaks"
sleep ${JOB_SLEEP:-0.15}
rmdir "$me"
echo x >> "$dir/done"
"#;

/// A scratch directory where jobs record themselves (see `JOB_SH`).
pub struct JobTree {
    pub dir: PathBuf,
}

impl JobTree {
    pub fn new(name: &str) -> JobTree {
        let dir = std::env::temp_dir().join(format!("herdless-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("running")).unwrap();
        std::fs::write(dir.join("job.sh"), JOB_SH).unwrap();
        JobTree { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A Makefile (GNU and bmake syntax alike) of `n` jobs named `p1..pn`.
    pub fn flat_makefile(&self, name: &str, prefix: &str, n: usize) {
        let targets: Vec<String> = (1..=n).map(|i| format!("{prefix}{i}")).collect();
        let mut mk = format!("all: {}\n", targets.join(" "));
        for t in &targets {
            mk += &format!("{t}:\n\t@sh {0}/job.sh {0}\n", self.dir.display());
        }
        std::fs::write(self.path(name), mk).unwrap();
    }

    /// A recursive tree: the top Makefile runs `branches` sub-makes of
    /// `per` jobs each.
    pub fn recursive_makefile(&self, branches: usize, per: usize) {
        let subs: Vec<String> = (1..=branches).map(|b| format!("branch{b}")).collect();
        let mut top = format!("all: {}\n", subs.join(" "));
        for (b, sub) in subs.iter().enumerate() {
            let file = format!("sub{}.mk", b + 1);
            self.flat_makefile(&file, &format!("b{}j", b + 1), per);
            top += &format!("{sub}:\n\t@${{MAKE}} -f {}\n", self.path(&file).display());
        }
        std::fs::write(self.path("Makefile"), top).unwrap();
    }

    /// (jobs done, most running at once)
    pub fn counts(&self) -> (usize, u32) {
        let done = std::fs::read_to_string(self.path("done")).unwrap_or_default();
        let peaks = std::fs::read_to_string(self.path("peaks")).unwrap_or_default();
        let max = peaks
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .max()
            .unwrap_or(0);
        (done.lines().count(), max)
    }
}

impl Drop for JobTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The value of a `herdless: KEY …` line of `--stats` output.
pub fn stat(stderr: &str, key: &str) -> String {
    stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("herdless: ")
                .and_then(|l| l.strip_prefix(key))
        })
        .unwrap_or_else(|| panic!("no {key:?} line in:\n{stderr}"))
        .trim()
        .to_string()
}

/// Panics with the command that installs `tool` when it is not in PATH.
pub fn require(tool: &str) {
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .any(|dir| dir.join(tool).is_file());
    assert!(
        found,
        "{tool} is not installed: `bash ci/test` installs it (ci/install-tools.sh)"
    );
}

/// The figures of each broker a make with herdless inside started, one
/// line each in the file its `HERDLESS_MAKE_STATS` named: `key value`
/// pairs.
pub fn make_stats(file: &Path) -> Vec<Vec<(String, i64)>> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.chunks(2)
                .map(|kv| (kv[0].to_string(), kv[1].parse().unwrap()))
                .collect()
        })
        .collect()
}

/// The value of `key` in one line of [`make_stats`].
pub fn figure(line: &[(String, i64)], key: &str) -> i64 {
    line.iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .1
}

/// A file the repository's scripts build under `target/` (`rel`), or the
/// one environment variable `var` names; `how` builds it.
pub fn repo_file(rel: &str, var: &str, how: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(rel));
    assert!(
        path.exists(),
        "{} not found: run `{how}` (CI does), or name it in {var}",
        path.display()
    );
    path
}

/// The venv that ci/install-python-tools.sh fills (ninja,
/// prometheus_client): `HERDLESS_TOOLS_VENV`, or `target/tools/venv`.
pub fn tools_venv() -> PathBuf {
    std::env::var_os("HERDLESS_TOOLS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tools/venv"))
}

/// A program of the tools venv; panics, naming the install command, when
/// it is missing.
pub fn venv_bin(name: &str) -> PathBuf {
    let path = tools_venv().join("bin").join(name);
    assert!(
        path.is_file(),
        "{} not found: `bash ci/test` installs it (ci/install-python-tools.sh)",
        path.display()
    );
    path
}

/// `herdless run ARGS…` in `dir` with no outer jobserver in its
/// environment.
#[allow(dead_code)]
pub fn run_command(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("run")
        .args(args)
        .current_dir(dir)
        .env("PATH", path_with_bin())
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .env_remove("HERDLESS_SOCKET")
        .env_remove("HERDLESS_CLASSIC");
    cmd
}

/// `herdless run ARGS…` in `dir` with no outer jobserver, bounded in time.
pub fn run_in(dir: &Path, args: &[&str]) -> std::process::Output {
    output_within(&mut run_command(dir, args), PATIENCE * 4)
}

/// A plain client's `Hello` frame (no flags, no slot), for tests that speak
/// the protocol over a raw socket.
#[allow(dead_code)] // not every test binary speaks raw frames
pub fn plain_hello() -> Vec<u8> {
    let mut out = Vec::new();
    herdless::protocol::Request::Hello {
        version: herdless::protocol::PROTOCOL_VERSION,
        flags: herdless::protocol::HelloFlags::empty(),
        pid: std::process::id(),
        slot: 0,
    }
    .encode(&mut out);
    out
}

/// A small offline workspace of `crates` crates without dependencies, each
/// enough code that its rustc runs for a moment.
pub fn cargo_workspace(ws: &Path, crates: usize) {
    let members: Vec<String> = (1..=crates).map(|i| format!("c{i}")).collect();
    std::fs::create_dir_all(ws).unwrap();
    let list: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
    std::fs::write(
        ws.join("Cargo.toml"),
        format!(
            "[workspace]\nresolver = \"2\"\nmembers = [{}]\n",
            list.join(", ")
        ),
    )
    .unwrap();
    for m in &members {
        std::fs::create_dir_all(ws.join(m).join("src")).unwrap();
        std::fs::write(
            ws.join(m).join("Cargo.toml"),
            format!("[package]\nname = \"{m}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n"),
        )
        .unwrap();
        let body: String = (0..200)
            .map(|i| {
                format!("pub fn f{i}(x: u64) -> u64 {{ x.wrapping_mul({i}).rotate_left(3) }}\n")
            })
            .collect();
        std::fs::write(ws.join(m).join("src/lib.rs"), body).unwrap();
    }
}

/// Kills a whole process group with SIGKILL when dropped: a test that
/// starts a tree in a group of its own (`process_group(0)`) leaves none of
/// it behind, whatever it asserted.
#[allow(dead_code)]
pub struct KillGroupOnDrop(pub i32);

impl Drop for KillGroupOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// SplitMix64: small, seedable, good enough to pick operations and shapes
/// of a test from a seed it prints, so that a failure is made again.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// One of `from`.
    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

/// Runs this test binary's `helper_process`, in role `role` (with `env`),
/// as the command of `herdless run -j JOBS --stats`, checks that the run
/// succeeded, and returns the line the role printed after `prefix`, and
/// the run's standard error.
#[allow(dead_code)]
pub fn run_role(jobs: u32, role: &str, env: &[(&str, &str)], prefix: &str) -> (String, String) {
    let out = Command::new(BIN)
        .args(["run", "-j", &jobs.to_string(), "--stats", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", role)
        .envs(env.iter().copied())
        .env_remove("MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{role}: {stdout}{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("{role}: no line `{prefix}`: {stdout}{stderr}"))
        .to_owned();
    eprintln!("{role}: {line}");
    (line, stderr)
}

/// The number after `name ` in a line of figures such as `run_role`'s.
#[allow(dead_code)]
pub fn number_after(line: &str, name: &str) -> u64 {
    let rest = line
        .split(&format!("{name} "))
        .nth(1)
        .unwrap_or_else(|| panic!("no `{name}` in: {line}"));
    rest.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{name}` in: {line}"))
}
