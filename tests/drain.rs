//! `Stopper::stop_when_idle` (the broker of a top-level make, drained
//! before it exits: `herdless_broker_drain` in the C ABI): the broker
//! serves on until no job runner and no connection in its handshake is
//! left, and waits for nothing else: not for a job that borrows the top's
//! slot (`herdless exec` in the background), not for an observer.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use herdless::broker::{Broker, Config};
use herdless::status::Status;
use herdless::Client;

use common::{BIN, PATIENCE};

fn clients(c: &Client) -> usize {
    let s: Status = serde_json::from_str(&c.status_json().unwrap()).unwrap();
    s.clients.len()
}

/// Waits until `cond` holds, at most `PATIENCE`.
fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_drain_waits_for_job_runners_and_handshakes_only() {
    let dir = std::env::temp_dir().join(format!("herdless-drain-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("broker.sock");
    let broker = Broker::bind(&socket, Config::new(4)).unwrap();
    let stopper = broker.stopper();
    let ended = thread::spawn(move || broker.run());

    // A job runner (a client with an implicit token of its own, as a make
    // is), a job of the top in the background (`herdless exec` whose
    // command sleeps; it borrows the top's slot), and an observer.
    let runner = Client::connect(&socket).unwrap();
    let mut job = Command::new(BIN);
    job.args(["exec", "--", "sleep", "60"])
        .env("HERDLESS_SOCKET", &socket)
        .env("PATH", common::path_with_bin())
        .stdin(Stdio::null());
    for var in [
        "HERDLESS_SLOT",
        "HERDLESS_CLASSIC",
        "MAKELEVEL",
        "MAKEFLAGS",
        "MFLAGS",
        "CARGO_MAKEFLAGS",
    ] {
        job.env_remove(var);
    }
    let mut job = job.spawn().unwrap();
    until("the job connected", || clients(&runner) == 2);
    let observer = Client::observe(&socket).unwrap();

    stopper.stop_when_idle();
    // The runner is still served: its implicit token and all three shared
    // ones (the job runs in the top's slot).
    let tokens: Vec<_> = (0..4).map(|_| runner.acquire().unwrap()).collect();
    thread::sleep(Duration::from_millis(200));
    assert!(
        !ended.is_finished(),
        "the drain ended with a runner connected"
    );

    // A connection that has not said hello yet may be a make: it holds the
    // drain too, until it closes.
    let mut silent = UnixStream::connect(&socket).unwrap();
    silent.flush().unwrap();
    drop(tokens);
    drop(runner);
    thread::sleep(Duration::from_millis(200));
    assert!(
        !ended.is_finished(),
        "the drain ended with a connection in its handshake"
    );
    drop(silent);

    // Only the job of the top and the observer are left: the broker ends.
    until("the drain ended", || ended.is_finished());
    let status = ended.join().unwrap().unwrap();
    assert_eq!(status.lost, 0, "{status:?}");
    assert!(job.try_wait().unwrap().is_none(), "the job ended first");
    let _ = job.kill();
    let _ = job.wait();
    drop(observer);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Connections that never say hello hold a drain only until their
/// handshake deadline: a flood of them during the drain cannot keep the
/// broker for good, and the runner among them is served throughout.
#[test]
fn a_flood_of_silent_connections_holds_a_drain_only_until_their_deadline() {
    let dir = std::env::temp_dir().join(format!("herdless-drain-flood-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("broker.sock");
    let mut config = Config::new(3);
    config.handshake_deadline = Duration::from_millis(500);
    assert!(config.handshake_deadline < PATIENCE);
    let broker = Broker::bind(&socket, config).unwrap();
    let stopper = broker.stopper();
    let ended = thread::spawn(move || broker.run());

    let runner = Client::connect(&socket).unwrap();
    stopper.stop_when_idle();
    // Two hundred connections that say nothing, opened while the runner
    // still works; the runner's tokens still come.
    let since = Instant::now();
    let silent: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let tokens: Vec<_> = (0..3).map(|_| runner.acquire().unwrap()).collect();
    drop(tokens);
    drop(runner);
    until("the drain ended", || ended.is_finished());
    // Each was accepted after it connected, and closed no sooner than its
    // deadline after that.
    assert!(
        since.elapsed() >= Duration::from_millis(500),
        "the drain ended before the silent connections were closed: {:?}",
        since.elapsed()
    );
    let status = ended.join().unwrap().unwrap();
    assert_eq!(status.lost, 0, "{status:?}");
    // The broker closed each one at its deadline.
    for mut s in silent {
        use std::io::Read;
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        // What it was told, if anything, then the end.
        let mut told = Vec::new();
        assert!(
            s.read_to_end(&mut told).is_ok(),
            "a silent connection outlived the broker"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
