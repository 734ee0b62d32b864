//! Shared pieces of the classic-client tests: token pipes and fifos made
//! here, a job script that records how many jobs run at once, the real
//! programs, and a watchdog that turns a hang into a failure.
#![allow(dead_code)]

use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};

/// The variables that name jobservers; removed from every child first.
pub const JOBSERVER_VARS: [&str; 4] = ["HERDLESS_SOCKET", "CARGO_MAKEFLAGS", "MAKEFLAGS", "MFLAGS"];

/// The herdless binary.
pub fn herdless() -> &'static str {
    env!("CARGO_BIN_EXE_herdless")
}

/// Tests that run many processes take turns: the machine may have two
/// cores, and the peaks are clearer one test at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A private temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let base = std::env::temp_dir().join(format!("herdless-test-{tag}-XXXXXX"));
        TempDir(nix::unistd::mkdtemp(&base).expect("mkdtemp"))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn set_nonblocking(fd: &OwnedFd) {
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL).unwrap());
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).unwrap();
}

/// Reads everything in `fd` without blocking (the description must be
/// non-blocking).
pub fn drain(fd: &OwnedFd) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match nix::unistd::read(fd, &mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(Errno::EAGAIN) => return out,
            Err(Errno::EINTR) => {}
            Err(e) => panic!("reading the token pipe: {e}"),
        }
    }
}

/// A token pipe made by the test, as a make would make it: inheritable
/// descriptors (no `FD_CLOEXEC`), a non-blocking read end (as GNU make 4.3
/// and bmake make theirs).
pub struct TokenPipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
}

impl TokenPipe {
    pub fn new(tokens: &[u8]) -> TokenPipe {
        let (read, write) = nix::unistd::pipe().expect("pipe");
        set_nonblocking(&read);
        let p = TokenPipe { read, write };
        p.put(tokens);
        p
    }

    /// A pipe whose descriptors are closed on exec, for this process only.
    pub fn private(tokens: &[u8]) -> TokenPipe {
        let (read, write) = herdless_platform::pipe_cloexec(false).expect("pipe");
        set_nonblocking(&read);
        let p = TokenPipe { read, write };
        p.put(tokens);
        p
    }

    pub fn put(&self, bytes: &[u8]) {
        assert_eq!(nix::unistd::write(&self.write, bytes).unwrap(), bytes.len());
    }

    pub fn fds(&self) -> (RawFd, RawFd) {
        (self.read.as_raw_fd(), self.write.as_raw_fd())
    }

    /// `R,W`.
    pub fn auth(&self) -> String {
        format!("{},{}", self.read.as_raw_fd(), self.write.as_raw_fd())
    }

    /// Takes every byte out of the pipe.
    pub fn drain(&self) -> Vec<u8> {
        drain(&self.read)
    }
}

/// A jobserver fifo made by the test, held open read-write so it never
/// reads end-of-file.
pub struct TokenFifo {
    pub path: PathBuf,
    fd: OwnedFd,
}

impl TokenFifo {
    pub fn new(dir: &Path, tokens: &[u8]) -> TokenFifo {
        let path = dir.join("jobserver.fifo");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Linux lets a fifo be opened read-write without waiting (fifo(7)).
        let fd: OwnedFd = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap()
            .into();
        assert_eq!(nix::unistd::write(&fd, tokens).unwrap(), tokens.len());
        TokenFifo { path, fd }
    }

    pub fn put(&self, bytes: &[u8]) {
        assert_eq!(nix::unistd::write(&self.fd, bytes).unwrap(), bytes.len());
    }

    pub fn drain(&self) -> Vec<u8> {
        drain(&self.fd)
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A job that records how many jobs run at once.
///
/// Each job creates a file of its own in `run/` on start (`mktemp`: jobs
/// in PID namespaces of their own may share a process id) and removes it
/// before it ends, both
/// inside its token's hold, so the number of files it counts never exceeds
/// the number of jobs that hold tokens: a count above the limit is a real
/// breach. To show the limit is also *reached*, a job started before any
/// job counted `want` waits (bounded, 20 s) until `want` run at once; after
/// that jobs just pass through.
pub struct Jobs {
    pub dir: TempDir,
}

impl Jobs {
    pub fn new(tag: &str) -> Jobs {
        let dir = TempDir::new(tag);
        fs::create_dir(dir.path().join("run")).unwrap();
        let script = dir.path().join("job.sh");
        fs::write(
            &script,
            r#"#!/bin/sh
# job.sh DIR WANT
d=$1; want=$2
me=$(mktemp "$d/run/job.XXXXXXXX") || exit 1
count() { ls "$d/run" | wc -l | tr -d ' '; }
n=$(count)
echo "$n" >> "$d/peaks"
if [ "$n" -ge "$want" ]; then : > "$d/reached"; fi
i=0
while [ ! -e "$d/reached" ] && [ $i -lt 400 ]; do
  sleep 0.05
  n=$(count)
  echo "$n" >> "$d/peaks"
  if [ "$n" -ge "$want" ]; then : > "$d/reached"; fi
  i=$((i+1))
done
rm -f "$me"
echo "$$" >> "$d/done"
"#,
        )
        .unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        Jobs { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The command line of one job that wants `want` jobs at once.
    pub fn job(&self, want: u32) -> String {
        format!(
            "sh {}/job.sh {} {want}",
            self.path().display(),
            self.path().display()
        )
    }

    /// The most jobs seen running at once.
    pub fn peak(&self) -> u32 {
        fs::read_to_string(self.path().join("peaks"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .max()
            .unwrap_or(0)
    }

    /// How many jobs finished.
    pub fn done(&self) -> usize {
        fs::read_to_string(self.path().join("done"))
            .unwrap_or_default()
            .lines()
            .count()
    }

    /// How many are running now (should be 0 at the end).
    pub fn running(&self) -> usize {
        fs::read_dir(self.path().join("run")).unwrap().count()
    }
}

/// A command with no jobserver of the environment's in it.
pub fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for v in JOBSERVER_VARS {
        cmd.env_remove(v);
    }
    cmd.env_remove("MAKELEVEL");
    cmd
}

/// Waits for `child`, killing it and failing after `limit` (a hang is a
/// deadlock; the limit is generous and never asserted as a time). Its
/// stdout and stderr, if piped, are read as it runs.
pub fn wait_or_kill(mut child: Child, limit: Duration, what: &str) -> Output {
    let out = child.stdout.take().map(read_all);
    let err = child.stderr.take().map(read_all);
    let collect = |h: Option<std::thread::JoinHandle<String>>| {
        h.map(|h| h.join().unwrap().into_bytes())
            .unwrap_or_default()
    };
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Output {
                status,
                stdout: collect(out),
                stderr: collect(err),
            };
        }
        if start.elapsed() > limit {
            // run() starts each command in a process group of its own:
            // end the whole tree, so that its output pipes close.
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish within {} s (deadlock?)\nstdout:\n{}\nstderr:\n{}",
                limit.as_secs(),
                String::from_utf8_lossy(&collect(out)),
                String::from_utf8_lossy(&collect(err))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `cmd` with piped output under [`wait_or_kill`].
pub fn run(cmd: &mut Command, what: &str) -> Output {
    use std::os::unix::process::CommandExt;
    let child = cmd
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    wait_or_kill(child, Duration::from_secs(120), what)
}

pub fn text(out: &Output) -> String {
    format!(
        "status: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn version_line(program: &Path) -> Option<String> {
    let out = Command::new(program).arg("--version").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .map(str::to_owned)
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// GNU make 4.3 (Debian's `/usr/bin/make`, pipe style). Fails the test
/// with a clear message when it is missing.
pub fn gnu_make_43() -> PathBuf {
    let path = PathBuf::from("/usr/bin/make");
    match version_line(&path) {
        Some(v) if v.starts_with("GNU Make 4.3") => path,
        other => panic!(
            "this test needs GNU make 4.3 at /usr/bin/make (Debian 12's `make` package; \
             ci/install-tools.sh installs it); found: {other:?}"
        ),
    }
}

/// GNU make 4.4.1 (fifo style): `$HERDLESS_GNU_MAKE_44`, else
/// `target/tools/gnu-make-4.4.1/bin/make`.
pub fn gnu_make_441() -> PathBuf {
    let path = std::env::var_os("HERDLESS_GNU_MAKE_44")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tools/gnu-make-4.4.1/bin/make")
        });
    match version_line(&path) {
        Some(v) if v.starts_with("GNU Make 4.4") => path,
        other => panic!(
            "this test needs GNU make 4.4.1 at {} (set HERDLESS_GNU_MAKE_44, or build it with \
             `bash ci/build-gnu-make-4.4.1.sh`); found: {other:?}",
            path.display()
        ),
    }
}

/// bmake, from PATH.
pub fn bmake() -> PathBuf {
    on_path("bmake").unwrap_or_else(|| {
        panic!(
            "this test needs bmake on PATH (Debian's `bmake` package; ci/install-tools.sh \
             installs it)"
        )
    })
}

/// Reads a child's whole stdout in a thread.
pub fn read_all(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// The real makes the tests drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Make {
    /// GNU make 4.3: a pipe, `--jobserver-auth=R,W`.
    Gnu43,
    /// GNU make 4.4.1: a fifo, `--jobserver-auth=fifo:PATH`.
    Gnu441,
    /// bmake: a pipe, `-J R,W`.
    Bmake,
}

impl Make {
    pub fn program(self) -> PathBuf {
        match self {
            Make::Gnu43 => gnu_make_43(),
            Make::Gnu441 => gnu_make_441(),
            Make::Bmake => bmake(),
        }
    }

    /// The byte the test puts in a jobserver for this make.
    pub fn token(self) -> u8 {
        if self == Make::Bmake {
            b'+'
        } else {
            b'|'
        }
    }

    /// MAKEFLAGS for `-j{jobs}` with `pipe` as the jobserver, in this
    /// make's words.
    pub fn pipe_flags(self, jobs: usize, pipe: &TokenPipe) -> String {
        match self {
            Make::Bmake => format!("-j {jobs} -J {}", pipe.auth()),
            _ => format!("-j{jobs} --jobserver-auth={}", pipe.auth()),
        }
    }
}

/// Where a make's tokens come from.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// The test's own pipe (GNU make 4.3, bmake) or fifo (GNU make 4.4.1)
    /// holding `tokens`, named in MAKEFLAGS: make runs as a sub-make with
    /// `-j(tokens + 1)`, and the tokens are counted afterwards.
    External { tokens: usize },
    /// `make -jN`: make makes its own.
    Direct { jobs: u32 },
}

/// What a make run under [`run_make`] did.
pub struct Ran {
    pub out: Output,
    /// The bytes left in the external pipe or fifo afterwards.
    pub left: Option<Vec<u8>>,
}

/// Runs `cmd`, a command line of `make` that runs in `dir`, with its
/// tokens from `server`, and drains the external jobserver afterwards.
pub fn run_make(make: Make, server: Server, cmd: &mut Command, dir: &Path, what: &str) -> Ran {
    match server {
        Server::Direct { jobs } => {
            cmd.arg(format!("-j{jobs}"));
            Ran {
                out: run(cmd, what),
                left: None,
            }
        }
        Server::External { tokens } => {
            let tokens = vec![make.token(); tokens];
            let j = tokens.len() + 1;
            if make == Make::Gnu441 {
                let fifo = TokenFifo::new(dir, &tokens);
                cmd.env(
                    "MAKEFLAGS",
                    format!("-j{j} --jobserver-auth=fifo:{}", fifo.path.display()),
                );
                let out = run(cmd, what);
                Ran {
                    out,
                    left: Some(fifo.drain()),
                }
            } else {
                let pipe = TokenPipe::new(&tokens);
                cmd.env("MAKEFLAGS", make.pipe_flags(j, &pipe));
                let out = run(cmd, what);
                Ran {
                    out,
                    left: Some(pipe.drain()),
                }
            }
        }
    }
}

/// Every token is back in the external jobserver: as many bytes as were
/// put in. GNU make writes `+` back whatever byte it read, so only bmake's
/// bytes are checked exactly.
pub fn assert_tokens_back(make: Make, left: &[u8], tokens: usize, what: &str) {
    assert_eq!(left.len(), tokens, "{what}: every token is back: {left:?}");
    let ok: &[u8] = if make == Make::Bmake { b"+" } else { b"|+" };
    assert!(left.iter().all(|b| ok.contains(b)), "{what}: {left:?}");
}
