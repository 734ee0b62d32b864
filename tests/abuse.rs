//! One misbehaving client of the broker's own user: it floods requests
//! without reading, queues acquires without end, opens connections that
//! never say hello, or idles by the thousand. The other clients are still
//! served, the broker's memory stays bounded, and no token is lost.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{plain_hello, Serve, BIN, PATIENCE};
use herdless::client::{Client, Options};
use herdless::protocol::{FrameBuffer, Reply, Request, BUSY_PREFIX};

/// The peak resident memory of `pid`, in KiB.
#[cfg(target_os = "linux")]
fn peak_rss_kib(pid: i32) -> u64 {
    herdless_platform::resident_kib(pid as u32)
        .expect("the broker's /proc/PID/status")
        .0
}

/// Reads what the broker sent until it closes (or `PATIENCE` passes):
/// the error message it closed with, if any.
fn closing_error(s: &mut UnixStream) -> Option<String> {
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut rx = FrameBuffer::new();
    let mut buf = [0u8; 4096];
    let mut error = None;
    loop {
        while let Ok(Some(reply)) = rx.next_reply() {
            if let Reply::Error { message } = reply {
                error = Some(message);
            }
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return error,
            Ok(n) => rx.extend(&buf[..n]),
        }
    }
}

/// A well-behaved client's rounds: connect, take and give back a token
/// (only try, when `try_only`: a flooder's tries may hold them all), read
/// the status. Each must succeed.
fn well_behaved_rounds(socket: &std::path::Path, rounds: usize, try_only: bool) {
    for i in 0..rounds {
        let c = Client::connect_with(socket, Options::default().implicit_token(false))
            .unwrap_or_else(|e| panic!("round {i}: {e}"));
        let t = if try_only {
            c.try_acquire()
        } else {
            c.acquire().map(Some)
        };
        if let Some(t) = t.unwrap_or_else(|e| panic!("round {i}: {e}")) {
            t.release().unwrap();
        }
        let json = Client::observe(socket).unwrap().json().unwrap();
        let _: herdless::status::Status = serde_json::from_str(&json).unwrap();
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_client_flooding_requests_without_reading_starves_no_one() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    for unit in [Request::Status, Request::TryAcquire, Request::Cancel] {
        let try_only = matches!(unit, Request::TryAcquire);
        let serve = Serve::start(3);
        let stop = Arc::new(AtomicBool::new(false));
        let name = unit.to_string();
        let flooder = {
            let (socket, stop) = (serve.socket.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&socket).unwrap();
                s.set_write_timeout(Some(Duration::from_millis(20)))
                    .unwrap();
                s.write_all(&plain_hello()).unwrap();
                let mut one = Vec::new();
                unit.encode(&mut one);
                let burst = one.repeat(4096);
                let mut sent = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(n) = s.write(&burst) {
                        sent += n;
                    }
                }
                (s, sent)
            })
        };
        // Served while the flood goes on.
        well_behaved_rounds(&serve.socket, 200, try_only);
        stop.store(true, Ordering::Relaxed);
        let (s, sent) = flooder.join().unwrap();
        assert!(sent > 0, "{name}: the flood never started");
        let peak = peak_rss_kib(serve.pid());
        assert!(peak < 64 * 1024, "{name} flood: broker peak RSS {peak} KiB");
        drop(s);
        let status = serve.wait_for("tokens back", |s| s.free == s.capacity);
        assert_eq!(status.lost, 0);
        let (exit, log) = serve.stop();
        assert!(exit.success(), "{log}");
        assert!(log.contains("tokens lost   0"), "{log}");
    }
}

#[test]
fn connections_that_never_say_hello_cannot_lock_anyone_out() {
    let serve = Serve::start(2);
    // More silent connections than the broker keeps in their handshake.
    let mut silent: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(&serve.socket).unwrap())
        .collect();
    // New clients still get in and are served.
    well_behaved_rounds(&serve.socket, 20, false);
    let s = serve.status();
    assert!(s.handshaking <= 256, "{} in their handshake", s.handshaking);
    // The oldest were turned away as busy; the rest time out.
    let messages: Vec<Option<String>> = silent.iter_mut().map(closing_error).collect();
    let busy = messages
        .iter()
        .filter(|m| m.as_deref().is_some_and(|m| m.starts_with(BUSY_PREFIX)))
        .count();
    let timed_out = messages
        .iter()
        .filter(|m| {
            m.as_deref()
                .is_some_and(|m| m.starts_with("no hello within"))
        })
        .count();
    assert!(busy >= 300 - 256, "{busy} turned away: {messages:?}");
    assert_eq!(busy + timed_out, 300, "{messages:?}");
    serve.wait_for("no handshakes left", |s| s.handshaking == 0);
    let (exit, log) = serve.stop();
    assert!(exit.success(), "{log}");
}

/// Reads the first reply on `s`, within `PATIENCE`.
#[cfg(target_os = "linux")]
fn first_reply(s: &mut UnixStream) -> Option<Reply> {
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut rx = FrameBuffer::new();
    let mut buf = [0u8; 256];
    loop {
        if let Some(reply) = rx.next_reply().unwrap() {
            return Some(reply);
        }
        let got = s.read(&mut buf).unwrap_or(0);
        if got == 0 {
            return None;
        }
        rx.extend(&buf[..got]);
    }
}

/// Stops `serve`'s broker with SIGSTOP and waits until every thread of
/// it is stopped, so that none accepts or reads from here on.
#[cfg(target_os = "linux")]
fn stop_broker(serve: &Serve) {
    common::signal(serve.pid(), libc::SIGSTOP);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{}/task", serve.pid()))
            .unwrap()
            .all(|task| {
                let tid = task.unwrap().file_name().to_string_lossy().parse().unwrap();
                herdless_platform::process_state(tid) == Some('T')
            })
    };
    let since = std::time::Instant::now();
    while !stopped() {
        assert!(since.elapsed() < PATIENCE, "the broker did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The listen queue holds a bounded number of connections: with the broker
/// stopped (SIGSTOP), non-blocking connects succeed until it is full and
/// then fail with `EAGAIN`. Once the broker runs again, every queued
/// connection is served, and so is a client that connects after them.
#[cfg(target_os = "linux")]
#[test]
fn the_listen_queue_is_bounded_and_every_queued_connection_is_served() {
    use herdless::broker::limits::LISTEN_BACKLOG;
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;

    let serve = Serve::start(2);
    let _ = serve.status();
    stop_broker(&serve);
    let addr = UnixAddr::new(&serve.socket).unwrap();
    let mut queued = Vec::new();
    let refused = loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => queued.push(UnixStream::from(fd)),
            Err(e) => break e,
        }
        assert!(
            queued.len() <= 4 * LISTEN_BACKLOG as usize,
            "the listen queue took {} connections",
            queued.len()
        );
    };
    assert_eq!(refused, nix::errno::Errno::EAGAIN);
    // Linux queues one more than the backlog.
    let n = queued.len();
    assert!(
        n == LISTEN_BACKLOG as usize || n == LISTEN_BACKLOG as usize + 1,
        "{n} connections queued for a backlog of {LISTEN_BACKLOG}"
    );
    for s in &mut queued {
        s.set_nonblocking(false).unwrap();
        s.write_all(&plain_hello()).unwrap();
    }
    common::signal(serve.pid(), libc::SIGCONT);
    // Each queued connection gets its welcome.
    for (i, s) in queued.iter_mut().enumerate() {
        let reply = first_reply(s);
        assert!(
            matches!(reply, Some(Reply::Welcome { .. })),
            "queued connection {i}: {reply:?}"
        );
    }
    well_behaved_rounds(&serve.socket, 5, false);
    // Every queued connection is a client still.
    serve.wait_for("the queued clients alone", |s| {
        s.clients_total as usize == n
    });
    drop(queued);
    let status = serve.wait_for("everyone gone", |s| s.clients_total == 0);
    assert_eq!(status.lost, 0);
    let (exit, log) = serve.stop();
    assert!(exit.success(), "{log}");
}

/// A broker stopped (SIGSTOP, Ctrl-Z of a make it runs in) past the
/// handshake deadline of connections it had accepted, whose hellos came
/// meanwhile behind more events than one poll returns: each hello is read
/// before its connection is given up on, and every one is welcomed.
#[cfg(target_os = "linux")]
#[test]
fn hellos_that_came_while_the_broker_was_stopped_are_read_before_the_deadline() {
    use herdless::broker::limits::HANDSHAKE_DEADLINE;
    let serve = Serve::start(2);
    // Clients in session, whose requests come first once it runs again.
    let mut talkers: Vec<UnixStream> = (0..40)
        .map(|_| {
            let mut s = UnixStream::connect(&serve.socket).unwrap();
            s.write_all(&plain_hello()).unwrap();
            assert!(matches!(first_reply(&mut s), Some(Reply::Welcome { .. })));
            s
        })
        .collect();
    // Accepted connections, silent so far.
    let mut silent: Vec<UnixStream> = (0..240)
        .map(|_| UnixStream::connect(&serve.socket).unwrap())
        .collect();
    serve.wait_for("every silent connection accepted", |s| s.handshaking == 240);
    stop_broker(&serve);
    let mut request = Vec::new();
    Request::TryAcquire.encode(&mut request);
    for s in &mut talkers {
        s.write_all(&request).unwrap();
    }
    for s in &mut silent {
        s.write_all(&plain_hello()).unwrap();
    }
    std::thread::sleep(HANDSHAKE_DEADLINE + Duration::from_millis(500));
    common::signal(serve.pid(), libc::SIGCONT);
    let replies: Vec<Option<Reply>> = silent.iter_mut().map(first_reply).collect();
    let refused: Vec<&Option<Reply>> = replies
        .iter()
        .filter(|r| !matches!(r, Some(Reply::Welcome { .. })))
        .collect();
    assert!(
        refused.is_empty(),
        "{} of 240 hellos given up on: {:?}",
        refused.len(),
        refused.first()
    );
    drop(silent);
    drop(talkers);
    let status = serve.wait_for("everyone gone", |s| s.clients_total == 0);
    assert_eq!(status.lost, 0);
    let (exit, log) = serve.stop();
    assert!(exit.success(), "{log}");
}

#[test]
fn the_broker_queues_a_bounded_number_of_acquires() {
    use herdless::broker::limits::{MAX_PENDING_ACQUIRES, MAX_QUEUED_ACQUIRES};
    // One token: the first acquire is granted, every other one waits.
    let serve = Serve::start(2);
    let per = MAX_PENDING_ACQUIRES as usize;
    let conns = MAX_QUEUED_ACQUIRES / per + 1;
    let mut queued = plain_hello();
    for _ in 0..per {
        Request::Acquire.encode(&mut queued);
    }
    let mut socks: Vec<UnixStream> = (0..conns)
        .map(|_| {
            let mut s = UnixStream::connect(&serve.socket).unwrap();
            s.write_all(&queued).unwrap();
            s
        })
        .collect();
    // Connections whose acquire would pass the cap are closed; the others
    // have all theirs queued.
    let s = serve.wait_for("the queue settled", |s| {
        s.clients_total < conns as u64
            && s.clients
                .iter()
                .all(|c| (c.waiting + c.held) as usize == per)
    });
    assert!(s.waiting as usize <= MAX_QUEUED_ACQUIRES, "{}", s.waiting);
    assert_eq!(
        s.waiting as usize + s.in_use as usize,
        s.clients_total as usize * per
    );
    // Each closed connection was told why.
    let mut told = 0;
    for sock in &mut socks {
        sock.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let closed = loop {
            match sock.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                Err(_) => break true,
            }
        };
        if closed {
            let mut rx = FrameBuffer::new();
            rx.extend(&got);
            let mut said = None;
            while let Ok(Some(reply)) = rx.next_reply() {
                if let Reply::Error { message } = reply {
                    said = Some(message);
                }
            }
            let said = said.expect("an error frame before the close");
            assert!(said.contains("acquires waiting"), "{said}");
            told += 1;
        }
    }
    assert_eq!(told as u64, conns as u64 - s.clients_total);
    // Everyone else is still served when the queue drains.
    drop(socks);
    well_behaved_rounds(&serve.socket, 5, false);
    let s = serve.wait_for("queue empty", |s| s.waiting == 0);
    assert_eq!(s.lost, 0);
}

#[cfg(target_os = "linux")]
#[test]
fn status_stays_valid_with_thousands_of_clients() {
    herdless_platform::raise_nofile_limit().unwrap();
    let serve = Serve::start(2);
    let idle: Vec<UnixStream> = (0..2000)
        .map(|_| {
            let mut s = UnixStream::connect(&serve.socket).unwrap();
            s.write_all(&plain_hello()).unwrap();
            s
        })
        .collect();
    let s = serve.wait_for("2000 clients", |s| s.clients_total >= 2000);
    assert_eq!(s.clients.len(), herdless::status::MAX_STATUS_CLIENTS);
    let out = std::process::Command::new(BIN)
        .args(["status", "--json", "--socket"])
        .arg(&serve.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(v["clients_total"], 2000);
    let out = std::process::Command::new(BIN)
        .args(["status", "--socket"])
        .arg(&serve.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("clients   2000 (256 listed"), "{text}");
    drop(idle);
}

#[test]
fn serve_refuses_a_symlinked_socket_directory() {
    let dir = std::env::temp_dir().join(format!("herdless-symlink-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    let real = dir.join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    // Where the test may (as root), the link belongs to another user.
    let _ = std::os::unix::fs::lchown(&link, Some(65534), Some(65534));
    let out = std::process::Command::new(BIN)
        .args(["serve", "-j", "2", "--socket"])
        .arg(link.join("s.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("symbolic link"), "{stderr}");
    assert!(!real.join("s.sock").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_client_that_dies_while_the_broker_ignores_it_gives_its_tokens_back() {
    let serve = Serve::start(3);
    for _ in 0..3 {
        let mut s = UnixStream::connect(&serve.socket).unwrap();
        let mut out = plain_hello();
        Request::Acquire.encode(&mut out);
        s.write_all(&out).unwrap();
        serve.wait_for("a token held", |st| st.in_use >= 1);
        // Status requests without reading, until the broker stops reading
        // them and the socket fills: the connection is paused.
        s.set_nonblocking(true).unwrap();
        let mut one = Vec::new();
        Request::Status.encode(&mut one);
        let burst = one.repeat(1024);
        let mut blocked = 0;
        while blocked < 50 {
            match s.write(&burst) {
                Ok(n) if n > 0 => blocked = 0,
                Ok(_) => blocked += 1,
                Err(_) => {
                    blocked += 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }
        drop(s);
        let st = serve.wait_for("the token back", |st| st.free == st.capacity);
        assert_eq!(st.lost, 0);
    }
    let (exit, log) = serve.stop();
    assert!(exit.success(), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
}
