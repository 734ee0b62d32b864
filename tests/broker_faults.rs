//! The broker's own failures and exits: killed under its clients, out of
//! file descriptors, stopped by a signal.

mod common;

use common::{Helper, Serve, PATIENCE};
use herdless::client::{Client, ErrorKind, Options};

#[test]
fn helper_process() {
    common::helper_main();
}

#[test]
fn clients_blocked_on_a_killed_broker_get_an_error_at_once() {
    let serve = Serve::start(2);
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiters: Vec<Helper> = (0..3)
        .map(|_| {
            let mut w = Helper::spawn(&serve.socket, "acquire-report", 1);
            assert_eq!(w.line(), "waiting");
            w
        })
        .collect();
    // One waiter in this process too, on another thread.
    let socket = serve.socket.clone();
    let in_process = std::thread::spawn(move || {
        let c = Client::connect_with(&socket, Options::default().implicit_token(false)).unwrap();
        c.acquire().map(|_| ()).map_err(|e| e.kind())
    });
    serve.wait_for("4 waiters", |s| s.waiting == 4);

    serve.kill();
    for w in &mut waiters {
        assert_eq!(w.line(), "error BrokerGone");
    }
    for mut w in waiters {
        let status = common::wait_timeout(&mut w.child, PATIENCE).expect("waiter hung");
        assert_eq!(status.code(), Some(4));
    }
    assert_eq!(in_process.join().unwrap(), Err(ErrorKind::BrokerGone));
    // The holder's next call fails too.
    holder.kill();
}

#[test]
fn serve_stops_cleanly_on_sigint_and_sigterm() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let serve = Serve::start(3);
        let socket = serve.socket.clone();
        let mut holder = Helper::spawn(&socket, "hold", 2);
        assert_eq!(holder.line(), "held 2");
        common::signal(serve.pid(), sig);
        let mut serve = serve;
        let status =
            common::wait_timeout(&mut serve.child, PATIENCE).expect("serve ignored the signal");
        assert!(status.success(), "{sig}: {status:?}");
        assert!(!socket.exists(), "socket left behind");
        assert!(!socket.parent().unwrap().exists(), "directory left behind");
        drop(serve);
        holder.kill();
    }
}

/// CPU time (user + system, in clock ticks) used so far by `pid`.
#[cfg(target_os = "linux")]
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_comm.split(' ').collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 here.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[cfg(target_os = "linux")]
#[test]
fn out_of_file_descriptors_keeps_serving_and_does_not_spin() {
    // A broker allowed 16 descriptors: a few for itself, a handful of clients.
    let serve = Serve::start_with(2, |cmd| {
        let bin = cmd.get_program().to_owned();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
        *cmd = std::process::Command::new("prlimit");
        cmd.arg("--nofile=16:16")
            .arg("--")
            .arg(bin)
            .args(args)
            .env("HERDLESS_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    });
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiter = Helper::spawn(&serve.socket, "acquire", 1);
    assert_eq!(waiter.line(), "waiting");

    // Open connections until the broker turns one away. Raw sockets: the
    // library's client would wait and try again.
    let mut extra = Vec::new();
    let refused = loop {
        assert!(extra.len() < 64, "the broker never ran out of descriptors");
        match raw_hello(&serve.socket) {
            Ok(s) => extra.push(s),
            Err(message) => break message,
        }
    };
    assert!(
        refused.starts_with(herdless::protocol::BUSY_PREFIX)
            && refused.contains("out of file descriptors"),
        "{refused}"
    );

    // Idle at the limit: the broker must not spin.
    let before = cpu_ticks(serve.pid());
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let used = cpu_ticks(serve.pid()) - before;
    assert!(
        used < 20,
        "broker used {used} ticks in 1 s while idle at its fd limit"
    );

    // A library client waits for a descriptor instead of failing.
    let socket = serve.socket.clone();
    let patient = std::thread::spawn(move || {
        Client::connect_with(&socket, Options::default().implicit_token(false))
            .map(|c| c.capacity())
            .map_err(|e| e.to_string())
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!patient.is_finished(), "the client gave up at once");

    // The clients it has are still served.
    holder.finish();
    assert_eq!(waiter.line(), "got");
    waiter.finish();
    // And once descriptors free up, the waiting client gets in.
    extra.clear();
    assert_eq!(patient.join().unwrap(), Ok(Some(1)));
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("asking a new client to retry"), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
}

/// Connects and says hello without the library: the welcome's stream, or
/// the broker's error message.
#[cfg(target_os = "linux")]
fn raw_hello(socket: &std::path::Path) -> Result<std::os::unix::net::UnixStream, String> {
    use herdless::protocol::{FrameBuffer, Reply};
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let out = common::plain_hello();
    // The broker may have written its refusal and closed already.
    let _ = s.write_all(&out);
    let mut rx = FrameBuffer::new();
    let mut buf = [0u8; 1024];
    loop {
        match rx.next_reply() {
            Ok(Some(Reply::Welcome { .. })) => return Ok(s),
            Ok(Some(Reply::Error { message })) => return Err(message),
            Ok(Some(other)) => panic!("unexpected {other}"),
            Ok(None) => {}
            Err(e) => panic!("{e}"),
        }
        match s.read(&mut buf) {
            Ok(0) => return Err("closed".into()),
            Ok(n) => rx.extend(&buf[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[test]
fn a_second_serve_leaves_the_first_one_alone() {
    let first = Serve::start(2);
    let out = std::process::Command::new(common::BIN)
        .args(["serve", "-j", "2", "--socket"])
        .arg(&first.socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("already listening"), "{stderr}");
    // The first broker's socket is still there and still answers.
    assert!(first.socket.exists());
    assert_eq!(first.status().jobs, 2);

    // A path that is some other file is refused, not deleted.
    let file = first.socket.with_file_name("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["serve", "-j", "2", "--socket"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a socket"));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    std::fs::remove_file(&file).unwrap();
}

/// A socket path longer than a socket address holds (107 bytes on Linux):
/// on Linux the broker binds it and clients reach it through its
/// directory, so clients in several processes share its tokens as with
/// any path; elsewhere `serve` refuses it and says the limit.
#[test]
fn a_socket_path_too_long_for_an_address_is_served_or_refused_with_the_limit() {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("long-socket-{}", std::process::id()));
    let socket = base
        .join("d".repeat(70))
        .join("e".repeat(70))
        .join("b.sock");
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    std::fs::set_permissions(
        socket.parent().unwrap(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    if !cfg!(target_os = "linux") {
        let out = std::process::Command::new(common::BIN)
            .args(["serve", "-j", "2", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(125));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("at most"), "{stderr}");
        return;
    }
    let serve = Serve::start_with(2, |c| {
        c.arg("--socket").arg(&socket);
    });
    assert_eq!(serve.socket, socket);
    let holder = {
        let mut h = Helper::spawn(&socket, "hold", 1);
        assert_eq!(h.line(), "held 1");
        h
    };
    let mut waiter = Helper::spawn(&socket, "acquire", 1);
    assert_eq!(waiter.line(), "waiting");
    serve.wait_for("1 waiter", |s| s.waiting == 1 && s.in_use == 1);
    assert!(holder.finish().success());
    assert_eq!(waiter.line(), "got");
    assert!(waiter.finish().success());
    let status = serve.status();
    assert_eq!((status.grants, status.in_use), (2, 0));
    drop(serve);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn replies_a_client_is_slow_to_read_all_arrive() {
    use herdless::protocol::{decode_reply, Reply, Request};
    use std::io::{Read, Write};
    let serve = Serve::start(2);
    let mut s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let mut out = common::plain_hello();
    // Far more status replies than a socket buffer holds, asked for before
    // reading any: the broker must keep the rest and send them as the
    // client reads.
    const N: usize = 3000;
    for _ in 0..N {
        Request::Status.encode(&mut out);
    }
    s.write_all(&out).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let (mut buf, mut at, mut statuses) = (Vec::new(), 0, 0);
    let mut chunk = [0u8; 65536];
    while statuses < N {
        let n = s.read(&mut chunk).expect("the replies stopped coming");
        assert!(n > 0, "the broker closed after {statuses} replies");
        buf.extend_from_slice(&chunk[..n]);
        while let Ok(Some((reply, used))) = decode_reply(&buf[at..]) {
            at += used;
            if matches!(reply, Reply::Status { .. }) {
                statuses += 1;
            }
        }
    }
    assert_eq!(statuses, N);
}
