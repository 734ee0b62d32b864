//! Bad input (ARCHITECTURE §4.7): a raw socket sends garbage, a wrong version, a
//! 1 MiB frame, or hangs up mid-frame. That one connection is closed with a
//! logged reason; the other clients keep being served; nothing is lost.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use common::{Helper, Serve};
use herdless::protocol::{decode_reply, HelloFlags, Reply, Request};

#[test]
fn helper_process() {
    common::helper_main();
}

/// Sends `bytes`, then reads until the broker closes; returns what it said.
fn send_raw(serve: &Serve, bytes: &[u8], hang_up: bool) -> Vec<Reply> {
    let mut s = UnixStream::connect(&serve.socket).unwrap();
    s.set_read_timeout(Some(common::PATIENCE)).unwrap();
    // A large frame may be refused before it is all written.
    let _ = s.write_all(bytes);
    if hang_up {
        drop(s);
        return Vec::new();
    }
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let mut replies = Vec::new();
    let mut at = 0;
    while let Ok(Some((reply, n))) = decode_reply(&got[at..]) {
        replies.push(reply);
        at += n;
    }
    replies
}

fn hello(version: u16) -> Vec<u8> {
    hello_as(version, HelloFlags::empty(), 0)
}

fn hello_as(version: u16, flags: HelloFlags, slot: u64) -> Vec<u8> {
    let mut v = Vec::new();
    Request::Hello {
        version,
        flags,
        pid: std::process::id(),
        slot,
    }
    .encode(&mut v);
    v
}

fn error_of(replies: &[Reply]) -> String {
    match replies.last() {
        Some(Reply::Error { message }) => message.clone(),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn bad_peers_are_cut_off_and_the_rest_go_on() {
    let serve = Serve::start(2); // one shared token
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiter = Helper::spawn(&serve.socket, "acquire", 1);
    assert_eq!(waiter.line(), "waiting");
    serve.wait_for("the waiter to queue", |s| s.waiting == 1);

    // Garbage instead of a hello.
    let r = send_raw(&serve, b"GET / HTTP/1.1\r\n\r\n", false);
    assert!(error_of(&r).contains("malformed frame"), "{r:?}");

    // A wrong protocol version.
    let r = send_raw(&serve, &hello(9), false);
    assert!(
        error_of(&r).contains("unsupported protocol version 9 (broker speaks 3 to 5)"),
        "{r:?}"
    );

    // A version 1 client (its hello is 4 bytes shorter): refused by its
    // version, with a message that says so, not as a malformed frame.
    let v1 = [
        0x0f, 0, 0, 0, 0x01, b'H', b'R', b'D', b'L', 1, 0, 0x01, 0x92, 0x10, 0, 0, 0xa0, 0x0f, 0, 0,
    ];
    let r = send_raw(&serve, &v1, false);
    assert!(
        error_of(&r).contains("unsupported protocol version 1 (broker speaks 3 to 5)"),
        "{r:?}"
    );

    // A 1 MiB frame, after a valid hello: refused from its header alone.
    let mut big = hello(herdless::protocol::PROTOCOL_VERSION);
    big.extend_from_slice(&(1u32 << 20).to_le_bytes());
    big.push(0x02);
    big.extend(std::iter::repeat_n(0u8, 1 << 20));
    let r = send_raw(&serve, &big, false);
    assert!(matches!(r.first(), Some(Reply::Welcome { .. })), "{r:?}");
    assert!(error_of(&r).contains("1048576-byte payload"), "{r:?}");

    // A frame other than hello first.
    let mut acquire = Vec::new();
    Request::Acquire.encode(&mut acquire);
    let r = send_raw(&serve, &acquire, false);
    assert!(error_of(&r).contains("expected a hello"), "{r:?}");

    // Half a hello, then hang up.
    let h = hello(herdless::protocol::PROTOCOL_VERSION);
    send_raw(&serve, &h[..7], true);

    // A client releasing a token it does not hold.
    let mut misuse = hello(herdless::protocol::PROTOCOL_VERSION);
    Request::Release.encode(&mut misuse);
    let r = send_raw(&serve, &misuse, false);
    assert!(error_of(&r).contains("does not hold"), "{r:?}");

    // A flood of acquires on one connection.
    let mut flood = hello(herdless::protocol::PROTOCOL_VERSION);
    for _ in 0..=herdless::broker::MAX_PENDING_ACQUIRES {
        Request::Acquire.encode(&mut flood);
    }
    let r = send_raw(&serve, &flood, false);
    assert!(
        error_of(&r).contains("acquires waiting on one connection"),
        "{r:?}"
    );

    // RUNNER without RECIPE_JOB.
    let v = hello_as(herdless::protocol::PROTOCOL_VERSION, HelloFlags::RUNNER, 0);
    let r = send_raw(&serve, &v, false);
    assert!(
        error_of(&r).contains("RUNNER goes with RECIPE_JOB only"),
        "{r:?}"
    );

    // A sub-make's hello in a recipe's slot is its acquire too: the slot,
    // free, is lent at once though a waiter is queued for the one shared
    // token (it is not one), its grant right after the welcome; given
    // back once, a second release is refused.
    let mut runner = hello_as(
        herdless::protocol::PROTOCOL_VERSION,
        HelloFlags::RECIPE_JOB | HelloFlags::RUNNER,
        u64::from(std::process::id()),
    );
    Request::Release.encode(&mut runner);
    Request::Release.encode(&mut runner);
    let r = send_raw(&serve, &runner, false);
    assert!(matches!(r.first(), Some(Reply::Welcome { .. })), "{r:?}");
    assert_eq!(r.get(1), Some(&Reply::Grant), "{r:?}");
    assert!(error_of(&r).contains("does not hold"), "{r:?}");

    // The well-behaved clients were never disturbed: the waiter is still
    // queued, and gets the token as soon as the holder lets go.
    let s = serve.wait_for("bad peers gone", |s| s.clients.len() == 2);
    assert_eq!((s.free, s.waiting), (0, 1));
    holder.finish();
    assert_eq!(waiter.line(), "got");
    waiter.finish();
    let s = serve.wait_for("all free", |s| s.clients.is_empty());
    assert_eq!(s.free, s.capacity);
    assert_eq!(s.lost, 0);

    let (status, log) = serve.stop();
    assert!(status.success());
    for reason in [
        "malformed frame: frame of kind 0x2f",
        "unsupported protocol version 9",
        "1048576-byte payload; the limit is 64",
        "expected a hello frame first",
        "in the middle of a frame (7 bytes unread)",
        "released a token it does not hold",
        "more than 4096 acquires waiting on one connection",
    ] {
        assert!(
            log.contains(reason),
            "no log line for {reason:?} in:\n{log}"
        );
    }
    assert!(log.contains("tokens lost   0"), "{log}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_peer_of_another_user_is_refused() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to connect as another user");
        return;
    }
    let serve = Serve::start(2);
    // Let another user reach the socket for this test only: the broker's
    // own check must then turn it away.
    let dir = serve.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    std::fs::set_permissions(
        &serve.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let said = connect_as_nobody(&serve.socket);
    assert!(said.contains("is not the broker's uid"), "{said}");
    let (_, log) = serve.stop();
    assert!(
        log.contains("peer uid 65534 is not the broker's uid 0"),
        "{log}"
    );
}

#[cfg(target_os = "linux")]
/// Connects as uid 65534 (through `setpriv` from util-linux, running
/// this test binary's `raw-hello` role) and returns what the broker said.
fn connect_as_nobody(socket: &std::path::Path) -> String {
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "raw-hello")
        .env("HERDLESS_SOCKET", socket)
        .output()
        .expect("run setpriv (util-linux)");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A `-j` out of range is refused with a clear error, by the library
/// (`Broker::bind`, `InvalidInput`) and by `herdless run`, and makes no
/// socket.
#[test]
fn a_jobs_figure_out_of_range_is_refused() {
    use herdless::broker::{Broker, Config, MAX_JOBS};
    let dir = std::env::temp_dir().join(format!("herdless-bad-jobs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("broker.sock");
    for jobs in [0, MAX_JOBS + 1, u32::MAX] {
        let e = Broker::bind(&socket, Config::new(jobs))
            .err()
            .expect("refused");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "-j {jobs}: {e}");
        assert!(e.to_string().contains("out of range"), "-j {jobs}: {e}");
        assert!(!socket.exists(), "-j {jobs} left a socket");
    }
    let broker = Broker::bind(&socket, Config::new(MAX_JOBS)).expect("-j MAX_JOBS");
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
    for jobs in ["0", "65537"] {
        let out = std::process::Command::new(common::BIN)
            .args(["run", "-j", jobs, "--", "true"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "-j {jobs}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not in 1..=65536"), "-j {jobs}: {err}");
    }
}
