//! The Rust client API against a real broker process: deadlines, try,
//! the implicit token, the poll-loop integration, threads.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::Serve;
use herdless::client::{Client, ErrorKind, Options};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

fn shared_only(serve: &Serve) -> Client {
    Client::connect_with(&serve.socket, Options::default().implicit_token(false)).unwrap()
}

#[test]
fn a_deadline_withdraws_the_request() {
    let serve = Serve::start(2); // one shared token
    let holder = shared_only(&serve);
    let held = holder.acquire().unwrap();
    let waiter = shared_only(&serve);
    for _ in 0..5 {
        let got = waiter
            .acquire_deadline(Instant::now() + Duration::from_millis(20))
            .unwrap();
        assert!(got.is_none(), "no token was free");
    }
    // Nothing is left queued at the broker, so nothing can be stranded.
    let s = serve.status();
    assert_eq!(s.waiting, 0, "{s:#?}");
    assert_eq!(s.cancelled, 5);
    // A wait that ended at its deadline granted nothing: the status says
    // grants = immediate + waits, waits being grants after a wait.
    assert_eq!((s.grants, s.immediate, s.waits), (1, 1, 0), "{s:#?}");
    drop(held);
    let s = serve.wait_for("the token back", |s| s.free == 1);
    assert_eq!(s.lost, 0);
    // And the next acquire works at once.
    let t = waiter.acquire_timeout(Duration::from_secs(30)).unwrap();
    assert!(t.is_some());
    // One that waits for it is granted after a wait.
    let again = std::thread::spawn(move || holder.acquire().map(|t| t.forget()).is_ok());
    serve.wait_for("the holder to wait", |s| s.waiting == 1);
    drop(t);
    assert!(again.join().unwrap());
    let s = serve.status();
    assert_eq!((s.grants, s.immediate, s.waits), (3, 2, 1), "{s:#?}");
}

#[test]
fn try_acquire_answers_at_once() {
    let serve = Serve::start(2);
    let a = shared_only(&serve);
    let t = a.try_acquire().unwrap().expect("one token is free");
    assert!(!t.is_implicit());
    assert!(a.try_acquire().unwrap().is_none(), "the only token is held");
    assert_eq!(serve.status().denied, 1);
    drop(t);
    serve.wait_for("the token back", |s| s.free == 1);
}

#[test]
fn the_implicit_token_comes_first_and_never_reaches_the_broker() {
    let serve = Serve::start(1); // -j 1: no shared token at all
    let c = Client::connect(&serve.socket).unwrap();
    let implicit = c.acquire().unwrap();
    assert!(implicit.is_implicit());
    assert_eq!(
        serve.status().grants,
        0,
        "no round trip for the implicit token"
    );
    // With the implicit token in use and no shared token, a second one
    // cannot be had.
    assert!(c.try_acquire().unwrap().is_none());
    drop(implicit);
    assert!(c
        .try_acquire()
        .unwrap()
        .expect("implicit again")
        .is_implicit());
}

#[test]
fn take_grant_drives_a_poll_loop() {
    let serve = Serve::start(2);
    let holder = shared_only(&serve);
    let held = holder.acquire().unwrap();
    let c = shared_only(&serve);
    // Nothing yet: a request is now pending and the fd is not readable.
    assert!(c.take_grant().unwrap().is_none());
    assert!(
        c.take_grant().unwrap().is_none(),
        "asking twice queues once"
    );
    serve.wait_for("one waiter", |s| s.waiting == 1);
    let mut fds = [PollFd::new(c.as_fd(), PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::ZERO).unwrap(), 0);
    drop(held);
    // The grant makes the fd readable; take_grant takes it.
    let mut fds = [PollFd::new(c.as_fd(), PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::from(30_000u16)).unwrap(), 1);
    let t = c.take_grant().unwrap().expect("the grant arrived");
    drop(t);
    let s = serve.wait_for("the token back", |s| s.free == 1);
    assert_eq!((s.waiting, s.lost), (0, 0));
}

#[test]
fn threads_share_one_client() {
    let serve = Serve::start(3); // two shared tokens
    let c = shared_only(&serve);
    let running = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (c, running, peak) = (c.clone(), running.clone(), peak.clone());
            std::thread::spawn(move || {
                for _ in 0..20 {
                    let t = c.acquire().unwrap();
                    let now = running.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(1));
                    running.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    drop(t);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(peak.load(std::sync::atomic::Ordering::SeqCst), 2);
    let s = serve.wait_for("all back", |s| s.free == 2);
    assert_eq!(s.grants, 160);
    assert_eq!(s.lost, 0);
}

#[test]
fn an_abort_reaches_every_client() {
    let serve = Serve::start(2);
    let holder = shared_only(&serve);
    let held = holder.acquire().unwrap();
    let waiter = shared_only(&serve);
    let w = std::thread::spawn(move || waiter.acquire().map(|_| ()).map_err(|e| e.kind()));
    serve.wait_for("the waiter", |s| s.waiting == 1);
    let other = shared_only(&serve);
    other
        .abort(herdless::protocol::AbortReason::Interrupt)
        .unwrap();
    assert_eq!(
        w.join().unwrap(),
        Err(ErrorKind::Aborted(
            herdless::protocol::AbortReason::Interrupt
        ))
    );
    let s = serve.status();
    assert_eq!(s.aborted.as_deref(), Some("I"));
    // Holders learn it too, and can still give their tokens back.
    let deadline = Instant::now() + common::PATIENCE;
    while holder.aborted().is_none() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(held);
    let s = serve.wait_for("the token back", |s| s.free == 1);
    assert_eq!(s.lost, 0);
}

#[test]
fn try_acquire_gets_a_token_left_unread_in_the_classic_pipe() {
    // Under `herdless run` every free token waits in the classic pipe
    // while no native client waits; a try-acquire must still get one.
    let out = std::process::Command::new(common::BIN)
        .args(["run", "-j", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "try-twice")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("role: tries 2 of 2"), "{stdout}");
}

#[test]
fn a_native_holding_and_waiting_is_not_stalled_by_an_unread_offer() {
    // Under `herdless run` with no classic client at all: a native that
    // holds a token and waits for a second must not wait for ever while a
    // token sits unread in the classic pipe.
    let stdout = role_under_run(3, "hold-and-wait");
    assert!(stdout.contains("role: second token granted"), "{stdout}");
}

/// Runs this binary's `role` as the command of `herdless run -j jobs`,
/// within a bound; its standard output, once it succeeded.
fn role_under_run(jobs: u32, role: &str) -> String {
    role_under_run_with(jobs, role, &[])
}

/// As [`role_under_run`], with more environment for the role.
fn role_under_run_with(jobs: u32, role: &str, env: &[(&str, &std::path::Path)]) -> String {
    let mut cmd = std::process::Command::new(common::BIN);
    cmd.args(["run", "-j", &jobs.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", role);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = common::output_within(&mut cmd, common::PATIENCE * 2);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn a_native_wait_gets_the_token_of_the_standing_offer() {
    // Under `herdless run -j 2` whose command is a native client, with no
    // classic client at all: the one shared token goes to the shared
    // table, and, while no native waits, into the classic pipe now and
    // then as the standing offer (the table stays open, with no free
    // word). A native that then waits, in the table, must get it: its wait
    // tells the broker, which takes the offer back for it. Rounds wait so,
    // with a blocking acquire or in a poll loop (with the poll-loop
    // hand-off on) in turn; a round that stalls fails the test.
    let stdout = role_under_run(2, "wait-for-the-offer");
    assert!(stdout.contains("role: 40 rounds"), "{stdout}");
}

#[test]
fn a_status_read_as_the_offer_is_made_shows_the_table_open_again() {
    // Under `herdless run -j 2` whose command is a native client, with no
    // classic client: one native takes the one shared token from the
    // table, holds it while the bridge's offer falls due (the broker then
    // asks for the offer in its queue and half-opens the table), gives it
    // back and at once asks for the broker's status. Whichever of the
    // give-back and the status request the broker reads first, the token
    // becomes the standing offer and the table opens again before the
    // status is written: a status never shows a state the broker is
    // about to leave (the offer out, nobody waiting, the table shut).
    // Each round then takes the token again.
    let stdout = role_under_run(2, "hold-across-the-offer");
    assert!(stdout.contains("role: 200 rounds"), "{stdout}");
}

#[test]
fn natives_contending_around_the_standing_offer_stay_within_the_limit() {
    // Under `herdless run -j 2` whose command is a native client, four
    // native processes without an implicit token take the one shared
    // token in turn, by blocking acquires and poll-loop waits, with pauses
    // in which none waits: the standing offer goes into the pipe and the
    // table stays open meanwhile, and each wait that follows must get the
    // offer back. Every round must end (no stall), and the log the
    // processes write while they hold the token must never show two at
    // once.
    let log = std::env::temp_dir().join(format!("herdless-test-offer-log-{}", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let stdout = role_under_run_with(
        2,
        "contend-around-the-offer",
        &[("HERDLESS_TEST_LOG", &log)],
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let (mut now, mut most, mut holds) = (0i32, 0i32, 0u32);
    for line in text.lines() {
        match line {
            "+" => {
                now += 1;
                holds += 1;
                most = most.max(now);
            }
            "-" => now -= 1,
            other => panic!("a bad log line: {other:?}"),
        }
    }
    assert_eq!(holds, CONTENDERS * CONTENDER_ROUNDS, "{stdout}");
    assert_eq!(
        most, 1,
        "two native processes held the one shared token at once"
    );
    let seen: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("role: contenders done, offer out with the table open "))
        .unwrap_or_else(|| panic!("{stdout}"))
        .trim()
        .parse()
        .unwrap();
    assert!(
        seen >= 1,
        "the standing offer was never seen out with the table open: {stdout}"
    );
}

const CONTENDERS: u32 = 4;
const CONTENDER_ROUNDS: u32 = 400;

/// The command of the test above: starts the contenders, and meanwhile
/// counts how often the broker's status shows the standing offer out
/// with the table open.
fn contend_around_the_offer() {
    let socket = herdless::client::socket_from_env().unwrap();
    let observer = Client::observe(&socket).unwrap();
    // The command connects natively, as a make with herdless inside does:
    // the classic side goes dormant and the table takes the free pool.
    let _native = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    let mut children: Vec<_> = (0..CONTENDERS)
        .map(|i| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "helper_process", "--nocapture"])
                .env("HERDLESS_TEST_ROLE", "contender")
                .env("HERDLESS_TEST_INDEX", i.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut seen = 0u32;
    let mut left = children.len();
    while left > 0 {
        assert!(start.elapsed() < common::PATIENCE, "a contender stalled");
        let s: herdless::status::Status = serde_json::from_str(&observer.json().unwrap()).unwrap();
        if s.classic.as_ref().is_some_and(|c| c.in_pipe == 1)
            && s.fast.as_ref().is_some_and(|f| f.open)
        {
            seen += 1;
        }
        left = 0;
        for c in &mut children {
            match c.try_wait().unwrap() {
                Some(st) => assert!(st.success(), "a contender failed: {st}"),
                None => left += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("role: contenders done, offer out with the table open {seen}");
}

/// One contender: rounds of take, note, hold, note, give back, with a
/// pause in which it does not wait after every other round or so.
fn contender() {
    use std::io::Write;
    let index: u64 = std::env::var("HERDLESS_TEST_INDEX")
        .unwrap()
        .parse()
        .unwrap();
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(std::env::var_os("HERDLESS_TEST_LOG").unwrap())
        .unwrap();
    let client = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    assert!(client.enable_poll_handoff().unwrap());
    // xorshift: a different, reproducible sequence per contender.
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (index + 1);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..CONTENDER_ROUNDS {
        let token = if round % 2 == 0 {
            client.acquire().unwrap()
        } else {
            loop {
                if let Some(t) = client.request_grant().unwrap() {
                    break t;
                }
                let mut fds = [PollFd::new(client.as_fd(), PollFlags::POLLIN)];
                let _ = poll(&mut fds, PollTimeout::from(5000u16));
            }
        };
        log.write_all(b"+\n").unwrap();
        std::thread::sleep(Duration::from_micros(next() % 300));
        log.write_all(b"-\n").unwrap();
        drop(token);
        if next() % 2 == 0 {
            std::thread::sleep(Duration::from_millis(1 + next() % 4));
        }
    }
}

fn wait_for_the_offer() {
    use std::os::fd::AsFd;
    let socket = herdless::client::socket_from_env().unwrap();
    let observer = Client::observe(&socket).unwrap();
    let status =
        || -> herdless::status::Status { serde_json::from_str(&observer.json().unwrap()).unwrap() };
    let blocking = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    let polling = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    assert!(polling.enable_poll_handoff().unwrap());
    // The standing offer comes back after a back-off counted in grants
    // (the bridge's rules); each round looks for it a while first.
    let mut with_offer = 0;
    for round in 0..40 {
        let start = Instant::now();
        let offered = loop {
            let s = status();
            if s.classic.as_ref().expect("a bridge").in_pipe == 1 {
                assert!(s.fast.as_ref().is_some_and(|f| f.open), "{s:#?}");
                break true;
            }
            if start.elapsed() > Duration::from_millis(50) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        with_offer += u32::from(offered);
        let start = Instant::now();
        if round % 2 == 0 {
            drop(blocking.acquire().unwrap());
        } else {
            let t = loop {
                if let Some(t) = polling.request_grant().unwrap() {
                    break t;
                }
                let mut fds = [nix::poll::PollFd::new(
                    polling.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5000u16));
                assert!(start.elapsed() < common::PATIENCE, "round {round}: poll");
            };
            drop(t);
        }
    }
    let s = status();
    let offered = s.classic.as_ref().map_or(0, |c| c.offered);
    assert!(
        with_offer >= 4 && offered >= u64::from(with_offer),
        "{with_offer} rounds began with the offer out, {offered} offers: {s:#?}"
    );
    println!("role: 40 rounds, {with_offer} with the offer out");
}

fn hold_across_the_offer() {
    let socket = herdless::client::socket_from_env().unwrap();
    let observer = Client::observe(&socket).unwrap();
    let client = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    let mut offers_seen = 0;
    for round in 0..200 {
        let token = client
            .acquire_timeout(common::PATIENCE)
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: no token within {:?}", common::PATIENCE));
        // Long enough for the broker to handle the take that made the
        // offer due before the give-back.
        std::thread::sleep(Duration::from_millis(1));
        drop(token);
        // Asked at once: the broker may read this before the give-back's
        // message, and finds the token freed in the table itself.
        let s: herdless::status::Status = serde_json::from_str(&observer.json().unwrap()).unwrap();
        let bridge = s.classic.as_ref().expect("a bridge");
        let fast = s.fast.as_ref().expect("a shared table");
        let waiting = s.waiting + fast.waiting;
        if bridge.in_pipe == 1 && waiting == 0 {
            offers_seen += 1;
            // With nobody waiting, the one token in the pipe is the
            // standing offer, which leaves the table open.
            assert!(fast.open, "round {round}: {s:#?}");
        }
    }
    assert!(offers_seen > 0, "no round saw the offer out");
    println!("role: 200 rounds, {offers_seen} with the offer out");
}

fn hold_and_wait() {
    let socket = herdless::client::socket_from_env().unwrap();
    let connect =
        || Client::connect_with(&socket, Options::default().implicit_token(false)).unwrap();
    let observer = Client::observe(&socket).unwrap();
    let waiting = || -> u32 {
        let s: herdless::status::Status = serde_json::from_str(&observer.json().unwrap()).unwrap();
        // At the broker, or in the shared table.
        s.clients.iter().map(|c| c.waiting).sum::<u32>() + s.fast.as_ref().map_or(0, |f| f.waiting)
    };
    let until = |what: &str, pred: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !pred() {
            assert!(
                start.elapsed() < common::PATIENCE,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let (a, b, c) = (connect(), connect(), connect());
    let a1 = a.acquire().unwrap();
    let b1 = b.acquire().unwrap();
    let c_thread = std::thread::spawn(move || c.acquire().map(drop));
    until("C to queue", &|| waiting() >= 1);
    let a2 = {
        let a = a.clone();
        std::thread::spawn(move || {
            a.acquire_timeout(Duration::from_secs(20))
                .map(|t| t.is_some())
        })
    };
    until("A to queue", &|| waiting() >= 2);
    // B's token goes to C, which gives it back at once: the next token
    // must reach A, which holds one and waits for another.
    drop(b1);
    c_thread.join().unwrap().unwrap();
    let granted = a2.join().unwrap().unwrap();
    println!(
        "role: second token {}",
        if granted { "granted" } else { "never came" }
    );
    drop(a1);
}

#[test]
fn helper_process() {
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("hold-and-wait") {
        hold_and_wait();
        std::process::exit(0);
    }
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("wait-for-the-offer") {
        wait_for_the_offer();
        std::process::exit(0);
    }
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("hold-across-the-offer") {
        hold_across_the_offer();
        std::process::exit(0);
    }
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("contend-around-the-offer") {
        contend_around_the_offer();
        std::process::exit(0);
    }
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("contender") {
        contender();
        std::process::exit(0);
    }
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("try-twice") {
        let c = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
        let a = c.try_acquire().unwrap();
        let b = c.try_acquire().unwrap();
        let n = a.is_some() as u32 + b.is_some() as u32;
        println!("role: tries {n} of 2");
        std::process::exit(0);
    }
}

/// A socket's name too long for a socket address even reached through its
/// directory (a longer path whose last part fits is reached that way on
/// Linux: `broker_faults.rs`).
#[test]
fn a_socket_path_too_long_says_so() {
    let long = std::path::PathBuf::from(format!("/tmp/{}", "x".repeat(200)));
    let err = Client::connect(&long).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connect);
    assert_eq!(err.errno(), libc::ENAMETOOLONG, "{err}");
    assert!(err.to_string().contains("at most"), "{err}");
}

#[test]
fn cancel_pending_keeps_other_threads_waiting() {
    let serve = Serve::start(2); // one shared token
    let holder = shared_only(&serve);
    let held = holder.acquire().unwrap();
    let c = shared_only(&serve);
    let blocked = {
        let c = c.clone();
        std::thread::spawn(move || c.acquire().map(|t| t.forget()).map_err(|e| e.kind()))
    };
    serve.wait_for("the blocked thread to queue", |s| s.waiting == 1);
    // Another thread of the same client asks without waiting, then gives
    // up: only its own request is withdrawn.
    assert!(c.take_grant().unwrap().is_none());
    assert!(c.cancel_pending().unwrap().is_none());
    let s = serve.status();
    assert_eq!(s.waiting, 1, "the blocked thread keeps its place: {s:#?}");
    drop(held);
    assert_eq!(blocked.join().unwrap(), Ok(()));
    c.release_raw().unwrap();
    let s = serve.wait_for("all back", |s| s.free == 1);
    assert_eq!(s.lost, 0);
}

#[test]
fn a_timeout_in_one_thread_withdraws_only_its_own_request() {
    let serve = Serve::start(2); // one shared token
    let holder = shared_only(&serve);
    let held = holder.acquire().unwrap();
    let c = shared_only(&serve);
    let blocked = {
        let c = c.clone();
        std::thread::spawn(move || c.acquire().map(|t| t.forget()).map_err(|e| e.kind()))
    };
    serve.wait_for("the blocked thread to queue", |s| s.waiting == 1);
    assert!(c
        .acquire_timeout(Duration::from_millis(50))
        .unwrap()
        .is_none());
    let s = serve.status();
    assert_eq!((s.waiting, s.cancelled), (1, 1), "{s:#?}");
    drop(held);
    assert_eq!(blocked.join().unwrap(), Ok(()));
    c.release_raw().unwrap();
    serve.wait_for("all back", |s| s.free == 1);
}

#[test]
fn a_forgotten_implicit_token_is_released_locally() {
    let serve = Serve::start(2);
    let c = Client::connect(&serve.socket).unwrap();
    let implicit = c.acquire().unwrap();
    assert!(implicit.is_implicit());
    implicit.forget();
    c.release_raw().unwrap();
    // The broker never saw it, and the connection is still good.
    let s = serve.status();
    assert_eq!((s.grants, s.clients.len()), (0, 1), "{s:#?}");
    assert!(c
        .try_acquire()
        .unwrap()
        .expect("implicit again")
        .is_implicit());
}

#[test]
fn concurrent_status_calls_each_get_a_reply() {
    let serve = Serve::start(2);
    let c = shared_only(&serve);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || (0..50).all(|_| c.status_json().is_ok()))
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap());
    }
}

/// A client of the raw protocol, speaking `version`: what a make's glue
/// would say, without the library's bookkeeping in between.
struct Raw {
    s: std::os::unix::net::UnixStream,
    rx: herdless::protocol::FrameBuffer,
}

impl Raw {
    fn connect(serve: &Serve, version: u16) -> Raw {
        use herdless::protocol::{HelloFlags, Reply, Request};
        let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
        s.set_read_timeout(Some(common::PATIENCE)).unwrap();
        let mut raw = Raw {
            s,
            rx: herdless::protocol::FrameBuffer::new(),
        };
        raw.send(&[Request::Hello {
            version,
            flags: HelloFlags::empty(),
            pid: std::process::id(),
            slot: 0,
        }]);
        match raw.reply() {
            Reply::Welcome { version: v, .. } => assert_eq!(v, version),
            other => panic!("no welcome: {other}"),
        }
        raw
    }

    /// Writes `requests` in one write: the broker reads them in one go.
    fn send(&mut self, requests: &[herdless::protocol::Request]) {
        use std::io::Write;
        let mut out = Vec::new();
        for r in requests {
            r.encode(&mut out);
        }
        self.s.write_all(&out).unwrap();
    }

    fn reply(&mut self) -> herdless::protocol::Reply {
        use std::io::Read;
        loop {
            if let Some(r) = self.rx.next_reply().unwrap() {
                return r;
            }
            let mut buf = [0u8; 256];
            let n = self.s.read(&mut buf).expect("a reply in time");
            assert!(n > 0, "the broker closed the connection");
            self.rx.extend(&buf[..n]);
        }
    }
}

/// The race of a withdrawal nobody waits for: the broker grants the
/// request after the client last read its socket, and the withdrawal
/// comes after that grant. A client that will read the grant only at its
/// next call (a make asleep in its poll loop, which dropped the socket
/// from its set) would keep that token idle while another process waits.
/// Written here as the broker sees it, deterministically: the release
/// that lets the broker grant the client's second request and the
/// withdrawal arrive in one read.
#[test]
fn a_grant_that_raced_a_withdrawal_nobody_waits_for_goes_on_to_the_next_waiter() {
    use herdless::protocol::{Reply, Request, PROTOCOL_VERSION, TAKE_BACK_VERSION};
    for version in [TAKE_BACK_VERSION, PROTOCOL_VERSION] {
        let serve = Serve::start(2); // one shared token
        let mut a = Raw::connect(&serve, version);
        a.send(&[Request::Acquire]);
        assert_eq!(a.reply(), Reply::Grant);
        a.send(&[Request::Acquire]);
        serve.wait_for("a's second request to queue", |s| s.waiting == 1);
        let b = shared_only(&serve);
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || b.acquire().map(|t| t.forget()).map_err(|e| e.kind()))
        };
        serve.wait_for("b to queue behind a", |s| s.waiting == 2);
        // The token goes from a's first grant to its second request; the
        // withdrawal of that request finds it granted.
        let withdraw = if version == TAKE_BACK_VERSION {
            Request::CancelNowait
        } else {
            Request::Cancel
        };
        a.send(&[Request::Release, withdraw]);
        assert_eq!(a.reply(), Reply::Grant, "version {version}");
        if version == TAKE_BACK_VERSION {
            // Taken back at once: b has it while a still holds the grant
            // unread as far as the broker knows, and a is told.
            assert_eq!(a.reply(), Reply::TakenBack);
            assert_eq!(waiter.join().unwrap(), Ok(()));
            let s = serve.status();
            assert_eq!((s.raced_grants, s.waiting, s.free), (1, 0, 0), "{s:#?}");
        } else {
            // Without it the token stays with a, unused, while b waits,
            // until a reads the grant and gives it back.
            assert_eq!(a.reply(), Reply::Cancelled { cancelled: false });
            let s = serve.status();
            assert_eq!((s.raced_grants, s.waiting), (0, 1), "b still waits: {s:#?}");
            a.send(&[Request::Release]);
            assert_eq!(waiter.join().unwrap(), Ok(()));
        }
        b.release_raw().unwrap();
        drop(a);
        let s = serve.wait_for("every token back", |s| s.free == 1 && s.clients_total == 1);
        // a held nothing when it closed: nothing was taken from a client
        // that died.
        assert_eq!((s.reclaimed, s.lost), (0, 0), "{s:#?}");
    }
}

/// A stand-in for a broker of protocol [`TAKE_BACK_VERSION`], on a real
/// socket in a directory of its own: it welcomes one client (capacity 1,
/// no shared table), answers each later request with what `answer` says,
/// and returns the names of the requests it read once the client closes.
///
/// [`TAKE_BACK_VERSION`]: herdless::protocol::TAKE_BACK_VERSION
struct StandIn {
    dir: std::path::PathBuf,
    socket: std::path::PathBuf,
    broker: std::thread::JoinHandle<Vec<&'static str>>,
}

impl StandIn {
    fn start(
        name: &str,
        mut answer: impl FnMut(&herdless::protocol::Request) -> Vec<herdless::protocol::Reply>
            + Send
            + 'static,
    ) -> StandIn {
        use herdless::protocol::{decode_request, Reply, Request, TAKE_BACK_VERSION};
        use std::io::{Read, Write};
        let dir = std::env::temp_dir().join(format!("herdless-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("broker.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let broker = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut seen = Vec::new();
            let mut buf = [0u8; 256];
            loop {
                while let Ok(Some((req, used))) = decode_request(&got) {
                    got.drain(..used);
                    let mut out = Vec::new();
                    let replies = match &req {
                        Request::Hello { version, .. } => {
                            assert_eq!(*version, TAKE_BACK_VERSION);
                            vec![
                                Reply::Welcome {
                                    version: *version,
                                    capacity: 1,
                                    client_id: 1,
                                    slot: 9,
                                },
                                // No table from this stand-in.
                                Reply::Segment { owner: 0, words: 0 },
                            ]
                        }
                        other => answer(other),
                    };
                    for r in replies {
                        r.encode(&mut out);
                    }
                    s.write_all(&out).unwrap();
                    seen.push(req.name());
                }
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return seen,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        StandIn {
            dir,
            socket,
            broker,
        }
    }

    /// A client of it, asking for no implicit token.
    fn client(&self) -> Client {
        Client::connect_with(&self.socket, Options::default().implicit_token(false)).unwrap()
    }

    /// Ends the client `c` of it: reads past every answer it sent (a
    /// status round trip), finds nothing pending, closes; returns the
    /// requests it read, which hold no `Release` (every grant it sent
    /// was void: taken back).
    fn finish(self, c: Client) -> Vec<&'static str> {
        let _ = c.status_json();
        assert!(!c.has_pending().unwrap());
        drop(c);
        let seen = self.broker.join().unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
        assert!(
            !seen.contains(&"Release"),
            "the client gave back a token the broker had taken back: {seen:?}"
        );
        seen
    }
}

/// The client's side of the same race: a grant that the broker says it
/// took back is void. The broker here is a stand-in that answers the
/// withdrawal with the grant and `TakenBack` together, and records what
/// the client sends after: never a `Release` for that token.
#[test]
fn a_grant_the_broker_took_back_is_void_in_the_client() {
    use herdless::protocol::{Reply, Request};
    let broker = StandIn::start("takeback", |req| match req {
        Request::TryAcquire => vec![Reply::Denied],
        Request::CancelNowait => vec![Reply::Grant, Reply::TakenBack],
        Request::Status => vec![Reply::Status { json: "{}".into() }],
        _ => Vec::new(),
    });
    let c = broker.client();
    assert!(c.take_grant().unwrap().is_none(), "a request pending");
    c.cancel_pending_nowait().unwrap();
    // Once the answers are read: nothing pending, held or owed.
    let seen = broker.finish(c);
    assert!(seen.contains(&"CancelNowait"), "{seen:?}");
}

/// The same race with the broker's answer still on its way: the grant
/// that raced the withdrawal has arrived, its `TakenBack` not yet, and the
/// caller withdraws again. That grant is void as well: the second
/// withdrawal gives nothing back. It used to give it back as a grant
/// nobody wanted, and the broker, which had taken that token back
/// already, took one the client really held off its books instead (two
/// clients then held what the pool had left, `tests/c/cancel_race.c`), or
/// closed a client that held nothing for a release of a token it did not
/// hold. The stand-in sends the `TakenBack` only with its answer to a
/// later status request.
#[test]
fn a_grant_racing_an_unanswered_withdrawal_is_not_given_back_by_the_next() {
    use herdless::protocol::{Reply, Request};
    let broker = StandIn::start("takeback-late", move |req| match req {
        Request::TryAcquire => vec![Reply::Denied],
        Request::CancelNowait => vec![Reply::Grant],
        Request::Status => vec![Reply::TakenBack, Reply::Status { json: "{}".into() }],
        _ => Vec::new(),
    });
    let c = broker.client();
    assert!(c.take_grant().unwrap().is_none(), "a request pending");
    c.cancel_pending_nowait().unwrap();
    // The grant has arrived when the socket turns readable.
    let mut fds = [PollFd::new(c.as_fd(), PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::from(30_000u16)).unwrap(), 1);
    c.cancel_pending_nowait().unwrap();
    assert!(
        !c.has_pending().unwrap(),
        "a withdrawn request still pending"
    );
    let seen = broker.finish(c);
    assert_eq!(
        seen.iter().filter(|&&n| n == "CancelNowait").count(),
        1,
        "{seen:?}"
    );
}

/// Many clients asking without waiting, giving up at random moments
/// (`take_grant`, then `cancel_pending_nowait`), while tokens come and
/// go: some withdrawals race their grant, and the broker takes those back
/// (`raced_grants` in the status). Whatever the interleaving, at most the
/// pool's tokens are held at once, and every token is back at the end,
/// none of them taken from a client as if it had died.
#[test]
fn withdrawals_nobody_waits_for_lose_and_duplicate_nothing() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::sync::Arc;
    const SHARED: u32 = 2;
    let serve = Serve::start(SHARED + 1);
    let held = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let workers: Vec<_> = (0..6u64)
        .map(|w| {
            let c = shared_only(&serve);
            let (held, peak) = (held.clone(), peak.clone());
            std::thread::spawn(move || {
                let mut rng = common::Rng(0x5eed ^ w);
                let hold = |t: herdless::client::Token, rng: &mut common::Rng| {
                    let now = held.fetch_add(1, SeqCst) + 1;
                    peak.fetch_max(now, SeqCst);
                    std::thread::sleep(Duration::from_micros(rng.below(200)));
                    held.fetch_sub(1, SeqCst);
                    drop(t);
                };
                for _ in 0..300 {
                    if let Some(t) = c.take_grant().unwrap() {
                        hold(t, &mut rng);
                        continue;
                    }
                    // Give the grant a chance to be on its way, then give up.
                    std::thread::sleep(Duration::from_micros(rng.below(100)));
                    c.cancel_pending_nowait().unwrap();
                    assert!(
                        !c.has_pending().unwrap(),
                        "a withdrawn request still pending"
                    );
                }
                // As a make does before it exits (`herdless_client_free`):
                // the answers to its withdrawals are in before it closes,
                // so nothing it gave back or withdrew is left for the
                // broker to take back as from a client that died.
                drop(c.settle_pending(common::PATIENCE).unwrap());
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert!(
        peak.load(SeqCst) <= SHARED,
        "{} tokens held at once from a pool of {SHARED}",
        peak.load(SeqCst)
    );
    let s = serve.wait_for("every token back", |s| {
        s.free == SHARED && s.clients_total == 0
    });
    assert_eq!((s.waiting, s.reclaimed, s.lost), (0, 0, 0), "{s:#?}");
    eprintln!(
        "raced grants taken back: {}, cancelled: {}, grants: {}",
        s.raced_grants, s.cancelled, s.grants
    );
}

/// A client that withdraws and closes at once, while the broker hands it
/// the token it withdrew: the broker's write of that grant fails, and it
/// reads the withdrawal still in the socket before it closes the
/// connection, so the token goes on as taken back for a withdrawal, not
/// as reclaimed from a client that died. The broker is stopped while the
/// two clients write, so that it sees the release that frees the token
/// before the withdrawal and the close.
#[test]
fn a_withdrawal_left_in_a_closed_clients_socket_is_read_before_it_closes() {
    use herdless::protocol::{Reply, Request, TAKE_BACK_VERSION};
    let serve = Serve::start(3); // two shared tokens
    let mut a = Raw::connect(&serve, TAKE_BACK_VERSION);
    let mut c = Raw::connect(&serve, TAKE_BACK_VERSION);
    for r in [&mut a, &mut c] {
        r.send(&[Request::Acquire]);
        assert_eq!(r.reply(), Reply::Grant);
    }
    let mut b = Raw::connect(&serve, TAKE_BACK_VERSION);
    b.send(&[Request::Acquire]);
    serve.wait_for("b to queue", |s| s.waiting == 1);
    common::signal(serve.pid(), libc::SIGSTOP);
    a.send(&[Request::Release]);
    b.send(&[Request::CancelNowait]);
    drop(b);
    common::signal(serve.pid(), libc::SIGCONT);
    let s = serve.wait_for("b gone", |s| s.clients_total == 2 && s.free == 1);
    assert_eq!(
        (s.raced_grants, s.reclaimed, s.lost),
        (1, 0, 0),
        "the grant to b raced its withdrawal and b's close: {s:#?}"
    );
    drop((a, c));
}
