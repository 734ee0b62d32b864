//! herdless's client under a classic jobserver: the whole `Client` API on a
//! pipe and a fifo made here, error messages, bmake's abort token, and
//! several client processes under a `jobserver`-crate server.
//!
//! Some tests run this test binary again as a helper client process: the
//! `helper` test does nothing unless `HERDLESS_CLASSIC_HELPER` names a role.

mod classic_client_support;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use classic_client_support::{
    clean, herdless, run, serial, text, Jobs, TempDir, TokenFifo, TokenPipe,
};
use herdless::classic::{Auth, Flavor, Jobserver};
use herdless::client::{Client, ErrorKind, Options};
use herdless::protocol::AbortReason;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

const HELPER_ENV: &str = "HERDLESS_CLASSIC_HELPER";

fn gnu(pipe: &TokenPipe) -> Jobserver {
    let (read, write) = pipe.fds();
    Jobserver::new(Auth::Fds { read, write }, Flavor::Gnu, Some(4))
}

fn bmake(pipe: &TokenPipe) -> Jobserver {
    let (read, write) = pipe.fds();
    Jobserver::new(Auth::Fds { read, write }, Flavor::Bmake, Some(4))
}

fn no_implicit() -> Options {
    Options::default().implicit_token(false)
}

fn sorted(mut v: Vec<u8>) -> Vec<u8> {
    v.sort_unstable();
    v
}

#[test]
fn tokens_come_back_byte_for_byte() {
    let pipe = TokenPipe::private(b"abc");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    assert!(client.socket().is_none());
    assert_eq!(client.capacity(), Some(3));
    assert_eq!(client.jobserver().unwrap().flavor(), Flavor::Gnu);
    let t1 = client.try_acquire().unwrap().expect("a");
    let t2 = client.acquire().unwrap();
    let t3 = client
        .acquire_timeout(Duration::from_secs(5))
        .unwrap()
        .expect("c");
    assert!(!t1.is_implicit() && !t2.is_implicit() && !t3.is_implicit());
    assert!(client.try_acquire().unwrap().is_none(), "the pipe is empty");
    assert!(pipe.drain().is_empty());
    drop(t1);
    t2.release().unwrap();
    drop(t3);
    assert_eq!(sorted(pipe.drain()), b"abc", "every byte read goes back");
}

#[test]
fn dropping_the_client_gives_back_forgotten_tokens() {
    let pipe = TokenPipe::private(b"xy");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    client.acquire().unwrap().forget();
    client.acquire().unwrap().forget();
    assert!(pipe.drain().is_empty());
    drop(client);
    assert_eq!(
        sorted(pipe.drain()),
        b"xy",
        "no token leaves with the client"
    );
}

#[test]
fn the_implicit_token_comes_first_and_never_touches_the_pipe() {
    let pipe = TokenPipe::private(b"+");
    let client = Client::from_jobserver(gnu(&pipe), Options::default()).unwrap();
    let implicit = client.acquire().unwrap();
    assert!(implicit.is_implicit());
    let shared = client.acquire().unwrap();
    assert!(!shared.is_implicit());
    assert!(pipe.drain().is_empty());
    drop(implicit);
    // The implicit token is free again: no pipe byte needed.
    let again = client.try_acquire().unwrap().unwrap();
    assert!(again.is_implicit());
    drop(shared);
    assert_eq!(pipe.drain(), b"+");
}

#[test]
fn a_deadline_ends_the_wait_and_takes_nothing() {
    let pipe = TokenPipe::private(b"");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    assert!(client
        .acquire_timeout(Duration::from_millis(50))
        .unwrap()
        .is_none());
    pipe.put(b"x");
    let t = client
        .acquire_timeout(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    drop(t);
    assert_eq!(pipe.drain(), b"x");
}

#[test]
fn a_waiter_is_woken_by_a_released_token() {
    let pipe = Arc::new(TokenPipe::private(b""));
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let c = client.clone();
            std::thread::spawn(move || c.acquire().unwrap().forget())
        })
        .collect();
    pipe.put(b"123");
    for w in waiters {
        w.join().unwrap();
    }
    assert!(pipe.drain().is_empty());
    for _ in 0..3 {
        client.release_raw().unwrap();
    }
    assert_eq!(
        client.release_raw().unwrap_err().kind(),
        ErrorKind::NotHolding
    );
    assert_eq!(sorted(pipe.drain()), b"123");
}

/// One write of several tokens wakes one exclusive waiter (Linux's
/// `EPOLLEXCLUSIVE`); that waiter must pass the wake-up on, or the others
/// sleep on while tokens sit unread. Here every waiter is asleep in its
/// wait before the single three-byte write, so each must be woken through
/// the one before it.
#[cfg(target_os = "linux")]
#[test]
fn one_write_of_several_tokens_wakes_every_waiter() {
    for round in 0..20 {
        let pipe = Arc::new(TokenPipe::private(b""));
        let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let c = client.clone();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    tx.send(herdless_platform::current_tid().unwrap()).unwrap();
                    c.acquire().unwrap().forget();
                    tx.send(0).unwrap();
                })
            })
            .collect();
        let tids: Vec<i32> = (0..3).map(|_| rx.recv().unwrap()).collect();
        // Asleep means in the wait: nothing else in acquire sleeps while
        // nobody holds a token.
        while !tids
            .iter()
            .all(|&t| herdless_platform::process_state(t as u32) == Some('S'))
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        pipe.put(b"123");
        for _ in 0..3 {
            // A safety net against a hang, not a timing assertion.
            let got = rx.recv_timeout(Duration::from_secs(60));
            assert_eq!(
                got,
                Ok(0),
                "round {round}: a waiter slept on with tokens in the pipe"
            );
        }
        for w in waiters {
            w.join().unwrap();
        }
        assert!(pipe.drain().is_empty());
        for _ in 0..3 {
            client.release_raw().unwrap();
        }
        assert_eq!(sorted(pipe.drain()), b"123");
    }
}

#[test]
fn take_grant_and_the_fd_to_watch() {
    let pipe = TokenPipe::private(b"");
    let client = Client::from_jobserver(gnu(&pipe), Options::default()).unwrap();
    // Never the implicit token, and nothing to withdraw.
    assert!(client.take_grant().unwrap().is_none());
    assert!(client.cancel_pending().unwrap().is_none());
    pipe.put(b"t");
    let mut fds = [PollFd::new(client.as_fd(), PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::NONE).unwrap(), 1);
    let t = client.take_grant().unwrap().expect("a byte is there");
    assert!(!t.is_implicit());
    let mut fds = [PollFd::new(client.as_fd(), PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::ZERO).unwrap(), 0, "drained");
    drop(t);
    assert_eq!(pipe.drain(), b"t");
}

#[test]
fn a_signal_ends_an_interruptible_wait() {
    use std::os::unix::thread::JoinHandleExt;
    let flag = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, Arc::clone(&flag)).unwrap();
    let pipe = TokenPipe::private(b"");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    let c = client.clone();
    let waiter =
        std::thread::spawn(move || c.acquire_interruptible(None).map(|t| t.map(|t| t.forget())));
    let thread = waiter.as_pthread_t();
    // Signal until the wait ends: the first signal may land before it starts.
    while !waiter.is_finished() {
        // `thread` is not joined before the loop ends, so it stays valid.
        nix::sys::pthread::pthread_kill(thread, nix::sys::signal::Signal::SIGUSR1).unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = waiter.join().unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Interrupted);
    assert!(flag.load(Ordering::SeqCst));
    // Nothing was taken, nothing is pending.
    pipe.put(b"z");
    assert!(client.cancel_pending().unwrap().is_none());
    assert_eq!(pipe.drain(), b"z");
}

#[test]
fn a_fifo_jobserver_works_the_same() {
    let dir = TempDir::new("fifo-api");
    let fifo = TokenFifo::new(dir.path(), b"pq");
    let js = Jobserver::parse(
        "MAKEFLAGS",
        OsStr::new(&format!(
            " -j3 --jobserver-auth=fifo:{}",
            fifo.path.display()
        )),
    )
    .unwrap()
    .unwrap();
    let client = Client::from_jobserver(js, no_implicit()).unwrap();
    assert_eq!(client.capacity(), Some(2));
    let a = client.acquire().unwrap();
    let b = client.try_acquire().unwrap().unwrap();
    assert!(client
        .acquire_timeout(Duration::from_millis(20))
        .unwrap()
        .is_none());
    drop((a, b));
    assert_eq!(sorted(fifo.drain()), b"pq");
}

#[test]
fn status_is_native_only() {
    let pipe = TokenPipe::private(b"");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    let err = client.status_json().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(err.to_string().contains("needs a herdless broker"), "{err}");
}

#[test]
fn gnu_make_has_no_abort_token() {
    let pipe = TokenPipe::private(b"++");
    let client = Client::from_jobserver(gnu(&pipe), no_implicit()).unwrap();
    let err = client.abort(AbortReason::Error).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(err.to_string().contains("no abort token"), "{err}");
    assert_eq!(client.aborted(), None);
    // Nothing changed: the tokens are there and can be taken.
    assert!(client.try_acquire().unwrap().is_some());
    // And under GNU make, E is just a token.
    pipe.put(b"E");
    let t = client.acquire().unwrap();
    drop(t);
    assert_eq!(client.aborted(), None);
}

#[test]
fn bmake_abort_posted_by_this_client() {
    let pipe = TokenPipe::private(b"+++");
    let client = Client::from_jobserver(bmake(&pipe), no_implicit()).unwrap();
    let held = client.acquire().unwrap();
    client.abort(AbortReason::Interrupt).unwrap();
    assert_eq!(client.aborted(), Some(AbortReason::Interrupt));
    let err = client.acquire().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Aborted(AbortReason::Interrupt));
    // Like bmake: the tokens drained, the stopper left in; a token given
    // back after the abort becomes the stopper too, after another drain.
    drop(held);
    assert_eq!(pipe.drain(), b"I");
}

#[test]
fn bmake_abort_token_read_in_process() {
    let pipe = TokenPipe::private(b"");
    let client = Client::from_jobserver(bmake(&pipe), no_implicit()).unwrap();
    let c = client.clone();
    let waiter = std::thread::spawn(move || c.acquire().map(|t| t.forget()));
    pipe.put(b"E");
    let err = waiter.join().unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Aborted(AbortReason::Error));
    assert!(err.to_string().contains("aborted"), "{err}");
    assert_eq!(client.aborted(), Some(AbortReason::Error));
    assert_eq!(pipe.drain(), b"E", "the stopper is put back for the others");
}

// ---------------------------------------------------------------------
// Errors that name the fd or path and why.

fn open_err(makeflags: &str) -> String {
    let js = Jobserver::parse("MAKEFLAGS", OsStr::new(makeflags))
        .unwrap()
        .unwrap();
    let err = Client::from_jobserver(js, Options::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadJobserver, "{err}");
    err.to_string()
}

#[test]
fn errors_name_the_fd_and_why() {
    assert_eq!(
        open_err("k -j3 --jobserver-auth=900,901"),
        "MAKEFLAGS names jobserver fd 900, which is not open (was the recipe not marked with + ?)"
    );
    assert_eq!(
        open_err(" -j 4 -J 900,901"),
        "MAKEFLAGS names jobserver fd 900, which is not open (is the target not marked .MAKE?)"
    );
    let dir = TempDir::new("errors");
    let file = std::fs::File::create(dir.path().join("plain")).unwrap();
    let n = std::os::fd::AsRawFd::as_raw_fd(&file);
    let msg = open_err(&format!("--jobserver-auth={n},{n}"));
    assert!(
        msg.starts_with(&format!(
            "MAKEFLAGS names jobserver fd {n}, which is a regular file, not a pipe or fifo"
        )),
        "{msg}"
    );
    let pipe = TokenPipe::private(b"");
    let other = TokenPipe::private(b"");
    let (r, w) = pipe.fds();
    let msg = open_err(&format!("--jobserver-auth={w},{r}"));
    assert_eq!(
        msg,
        format!(
            "MAKEFLAGS names jobserver fd {w} as the read end, but it is open for writing only"
        )
    );
    let (r2, _) = other.fds();
    let msg = open_err(&format!("--jobserver-auth={r},{r2}"));
    assert!(
        msg.contains("as the write end, but it is open for reading only"),
        "{msg}"
    );
    let (_, w2) = other.fds();
    let msg = open_err(&format!("--jobserver-auth={r},{w2}"));
    assert_eq!(
        msg,
        format!("MAKEFLAGS names jobserver fds {r},{w2}, which are not the two ends of one pipe")
    );
    let missing = dir.path().join("no-such-fifo");
    let msg = open_err(&format!("--jobserver-auth=fifo:{}", missing.display()));
    assert_eq!(
        msg,
        format!(
            "MAKEFLAGS names jobserver fifo {}, which does not exist (did the make that created it exit?)",
            missing.display()
        )
    );
    let msg = open_err(&format!(
        "--jobserver-auth=fifo:{}",
        dir.path().join("plain").display()
    ));
    assert!(
        msg.ends_with("which is a regular file, not a fifo"),
        "{msg}"
    );
}

#[test]
fn a_disabled_jobserver_is_not_found() {
    let js = Jobserver::parse("MAKEFLAGS", OsStr::new("-j --jobserver-auth=-2,-2"))
        .unwrap()
        .unwrap();
    let err = Client::from_jobserver(js, Options::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.to_string().contains("disables the jobserver"), "{err}");
}

// ---------------------------------------------------------------------
// Helper processes.

/// Not a test: the body of a helper client process.
#[test]
fn helper() {
    let Ok(role) = std::env::var(HELPER_ENV) else {
        return;
    };
    let code = match role.as_str() {
        // Prints what from_env() found, then takes one non-implicit token.
        "from-env" => match Client::from_env_with(no_implicit()) {
            Ok(c) => {
                let js = c.jobserver().expect("classic");
                println!("HELPER: {} {}", js.var(), js.option());
                0
            }
            Err(e) => {
                println!("HELPER: error {:?}: {e}", e.kind());
                1
            }
        },
        // Waits for a token with no implicit one; reports how it ended.
        "wait" => {
            let c = Client::from_env_with(no_implicit()).expect("a jobserver");
            println!("HELPER: waiting");
            match c.acquire() {
                Ok(t) => {
                    println!("HELPER: got");
                    drop(t);
                    0
                }
                Err(e) => {
                    println!("HELPER: error {:?}", e.kind());
                    if matches!(e.kind(), ErrorKind::Aborted(_)) {
                        3
                    } else {
                        1
                    }
                }
            }
        }
        // Takes a token and keeps it until killed.
        "hold" => {
            let c = Client::from_env_with(no_implicit()).expect("a jobserver");
            println!("HELPER: waiting");
            let t = c.acquire().expect("a token");
            println!("HELPER: got");
            std::thread::sleep(Duration::from_secs(3600));
            drop(t);
            0
        }
        other => panic!("unknown helper role {other}"),
    };
    std::process::exit(code);
}

fn helper_cmd(role: &str) -> Command {
    let mut cmd = clean(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "helper",
        "--nocapture",
        "--test-threads",
        "1",
        "-q",
    ])
    .env(HELPER_ENV, role);
    cmd
}

fn helper_says(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("HELPER: ").map(str::to_owned))
        .collect()
}

#[test]
fn from_env_prefers_the_socket_then_cargo_makeflags() {
    let pipe = TokenPipe::new(b"");
    let auth = pipe.auth();
    let out = run(
        helper_cmd("from-env")
            .env(
                "CARGO_MAKEFLAGS",
                format!("-j --jobserver-fds={auth} --jobserver-auth={auth}"),
            )
            .env("MAKEFLAGS", "k -j3 --jobserver-auth=900,901"),
        "helper",
    );
    assert_eq!(
        helper_says(&out),
        [format!("CARGO_MAKEFLAGS --jobserver-auth={auth}")],
        "{}",
        text(&out)
    );
    let out = run(
        helper_cmd("from-env")
            .env("MAKEFLAGS", " -j 4 -J 900,901")
            .env("MFLAGS", format!("-j2 --jobserver-auth={auth}")),
        "helper",
    );
    assert_eq!(
        helper_says(&out),
        ["error BadJobserver: MAKEFLAGS names jobserver fd 900, which is not open (is the target not marked .MAKE?)"],
        "{}",
        text(&out)
    );
    let out = run(helper_cmd("from-env").env("MAKEFLAGS", "k -j4"), "helper");
    let says = helper_says(&out);
    assert!(
        says[0].starts_with("error NotFound: no jobserver: HERDLESS_SOCKET is not set"),
        "{says:?}"
    );
    // A socket wins over any MAKEFLAGS, and is not silently passed over.
    let dir = TempDir::new("no-broker");
    let out = run(
        helper_cmd("from-env")
            .env("HERDLESS_SOCKET", dir.path().join("absent.sock"))
            .env("MAKEFLAGS", format!("-j2 --jobserver-auth={auth}")),
        "helper",
    );
    assert!(
        helper_says(&out)[0].starts_with("error Connect"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_bmake_abort_token_stops_every_waiting_process() {
    let _serial = serial();
    for (byte, reason) in [(b'E', "Error"), (b'I', "Interrupt")] {
        let pipe = TokenPipe::new(b"");
        let mut children = Vec::new();
        for _ in 0..3 {
            let mut child = helper_cmd("wait")
                .env("MAKEFLAGS", format!(" -j 4 -J {}", pipe.auth()))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            // Wait until it is about to wait (a byte that arrives earlier is
            // read by its first claim: the outcome is the same).
            loop {
                let line = lines.next().expect("helper output").unwrap();
                if line == "HELPER: waiting" {
                    break;
                }
            }
            children.push((child, lines));
        }
        pipe.put(&[byte]);
        for (mut child, lines) in children {
            let status = child.wait().unwrap();
            let rest: Vec<String> = lines.map_while(Result::ok).collect();
            assert_eq!(status.code(), Some(3), "{rest:?}");
            assert!(
                rest.contains(&format!("HELPER: error Aborted({reason})")),
                "{rest:?}"
            );
        }
        // Each reader drained and put the stopper back: exactly one is left.
        assert_eq!(pipe.drain(), [byte]);
    }
}

/// Voluntary + involuntary context switches of every thread of `pid`.
#[cfg(target_os = "linux")]
fn switches(pid: u32) -> u64 {
    let c = herdless_platform::process_ctx_switches_all_threads(pid as i32).unwrap();
    c.voluntary + c.involuntary
}

/// Whether a thread of `pid` sleeps in `epoll_wait()`, from its `wchan`;
/// `None` where the kernel does not show it.
#[cfg(target_os = "linux")]
fn epoll_waiting(pid: u32) -> Option<bool> {
    let mut shown = false;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let wchan = std::fs::read_to_string(task.ok()?.path().join("wchan")).unwrap_or_default();
        if wchan.contains("epoll_wait") || wchan.contains("ep_poll") {
            return Some(true);
        }
        shown |= !wchan.is_empty() && wchan != "0";
    }
    shown.then_some(false)
}

/// Linux: the waiters sleep in `epoll_wait()` with `EPOLLEXCLUSIVE`, so
/// one byte written to the pipe wakes exactly one of them (ARCHITECTURE §2: one
/// idle waiter), where `poll()` would wake all 16.
#[cfg(target_os = "linux")]
#[test]
fn one_byte_wakes_one_of_16_waiting_processes() {
    let _serial = serial();
    let pipe = TokenPipe::new(b"");
    let mut waiters: Vec<_> = (0..16)
        .map(|_| {
            let mut child = helper_cmd("hold")
                .env(
                    "MAKEFLAGS",
                    format!("-j17 --jobserver-auth={}", pipe.auth()),
                )
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            loop {
                let line = lines.next().expect("helper output").unwrap();
                if line == "HELPER: waiting" {
                    break;
                }
            }
            (child, lines)
        })
        .collect();
    // Each helper's later lines, tagged with its index.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut children = Vec::new();
    for (i, (child, lines)) in waiters.drain(..).enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let _ = tx.send((i, line));
            }
        });
        children.push(child);
    }
    drop(tx);
    // Let the waiters settle into their wait before sampling: each has a
    // thread in epoll_wait() (where the kernel shows it), then a pause.
    for c in &children {
        let start = std::time::Instant::now();
        while epoll_waiting(c.id()) == Some(false) && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let before: Vec<u64> = children.iter().map(|c| switches(c.id())).collect();
    pipe.put(b"+");
    let (first, line) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a helper takes the byte");
    assert_eq!(line, "HELPER: got");
    // Give any spurious wake-up time to show.
    std::thread::sleep(Duration::from_millis(300));
    let after: Vec<u64> = children.iter().map(|c| switches(c.id())).collect();
    let woken: Vec<usize> = (0..16).filter(|&i| after[i] > before[i]).collect();
    for child in &mut children {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let others: Vec<_> = rx.iter().filter(|(_, l)| l == "HELPER: got").collect();
    assert!(others.is_empty(), "one byte, one taker: {others:?}");
    assert_eq!(
        woken,
        [first],
        "only the one that took it ran: {before:?} -> {after:?}"
    );
    assert!(pipe.drain().is_empty());
}

// ---------------------------------------------------------------------
// Several `herdless exec` processes under a `jobserver`-crate server.

fn exec_under(server: &jobserver::Client, jobs: &Jobs, n: usize, want: u32) {
    let children: Vec<_> = (0..n)
        .map(|_| {
            let mut cmd = clean(herdless());
            cmd.arg("exec").arg("--").args(jobs.job(want).split(' '));
            server.configure_make(&mut cmd);
            cmd.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out =
            classic_client_support::wait_or_kill(child, Duration::from_secs(120), "herdless exec");
        assert!(out.status.success(), "{}", text(&out));
    }
}

#[test]
fn exec_processes_under_a_jobserver_crate_pipe() {
    let _serial = serial();
    // 3 tokens, and the server's own (implicit) slot, which its children
    // share as jobs of their parent: at most 4 at once.
    let server = jobserver::Client::new(3).unwrap();
    let jobs = Jobs::new("crate-pipe");
    exec_under(&server, &jobs, 10, 4);
    assert_eq!(jobs.done(), 10);
    assert_eq!(jobs.running(), 0);
    assert_eq!(
        jobs.peak(),
        4,
        "3 tokens + the parent's slot, reached and never exceeded"
    );
    assert_eq!(
        server.available().unwrap(),
        3,
        "every token is back in the pipe"
    );
}

#[test]
fn exec_processes_with_one_token() {
    let _serial = serial();
    let server = jobserver::Client::new(1).unwrap();
    let jobs = Jobs::new("crate-one");
    exec_under(&server, &jobs, 6, 2);
    assert_eq!(jobs.done(), 6);
    assert_eq!(jobs.peak(), 2);
    assert_eq!(server.available().unwrap(), 1);
}

#[test]
fn exec_processes_with_no_token_share_the_parents_slot() {
    let _serial = serial();
    // -j1: no token in the pipe. Jobs of one parent take its one slot in
    // turn, and none deadlocks.
    let server = jobserver::Client::new(0).unwrap();
    let jobs = Jobs::new("crate-zero");
    exec_under(&server, &jobs, 4, 1);
    assert_eq!(jobs.done(), 4);
    assert_eq!(jobs.peak(), 1);
    assert_eq!(server.available().unwrap(), 0);
}

#[test]
fn exec_processes_under_a_fifo() {
    let _serial = serial();
    let dir = TempDir::new("fifo-exec");
    let fifo = TokenFifo::new(dir.path(), b"|||");
    let jobs = Jobs::new("fifo-exec");
    let children: Vec<_> = (0..10)
        .map(|_| {
            let mut cmd = clean(herdless());
            cmd.arg("exec").arg("--").args(jobs.job(4).split(' '));
            cmd.env(
                "MAKEFLAGS",
                format!("-j4 --jobserver-auth=fifo:{}", fifo.path.display()),
            );
            cmd.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out =
            classic_client_support::wait_or_kill(child, Duration::from_secs(120), "herdless exec");
        assert!(out.status.success(), "{}", text(&out));
    }
    assert_eq!(jobs.done(), 10);
    assert_eq!(jobs.peak(), 4);
    assert_eq!(fifo.drain(), b"|||");
}
