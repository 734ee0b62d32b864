//! The shared token table (the fast path, ARCHITECTURE §3) with real
//! processes: clients that take and give back tokens as fast as they can
//! are killed with SIGKILL at random points, over and over; no token is
//! lost or duplicated, at most N are held at once, and the broker counts
//! the table's grants.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{Helper, Rng, Serve, PATIENCE};
use herdless::client::{Client, Options};

const ROLE: &str = "HERDLESS_FAST_TEST_ROLE";
const DIR: &str = "HERDLESS_FAST_TEST_DIR";

#[test]
fn helper_process() {
    common::helper_main();
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    if role == "one-descriptor-free" {
        one_descriptor_free();
        std::process::exit(0);
    }
    if role == "two-descriptors-free" {
        two_descriptors_free();
        std::process::exit(0);
    }
    let client = Client::from_env_with(Options::default().implicit_token(false))
        .expect("connect to the broker");
    match role.as_str() {
        // Take and give back forever, recording in DIR/held how many live
        // processes hold a token at each take.
        "churn" => {
            println!("role: {}", client.token_path());
            let dir = PathBuf::from(std::env::var_os(DIR).expect("dir"));
            let me = std::process::id();
            // Between a release and the next ask, when set.
            let pause = std::env::var("HERDLESS_FAST_TEST_PAUSE_US")
                .ok()
                .and_then(|p| p.parse().ok())
                .map(Duration::from_micros);
            let mine = dir.join("held").join(me.to_string());
            let mut peaks = std::fs::OpenOptions::new()
                .append(true)
                .open(dir.join("peaks"))
                .expect("peaks");
            loop {
                let t = client.acquire().expect("acquire");
                std::fs::write(&mine, b"").expect("register");
                let n = live_holders(&dir.join("held"));
                // One write per record: appends of one write do not mix.
                peaks
                    .write_all(format!("{n} {me}\n").as_bytes())
                    .expect("record");
                std::fs::remove_file(&mine).expect("unregister");
                drop(t);
                if let Some(pause) = pause {
                    std::thread::sleep(pause);
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// Lowers this process's descriptor limit so that exactly `n` more can be
/// made.
fn leave_free(n: i32) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    // The lowest free descriptor is the next one made; with the limit `n`
    // above it, no more than `n` can be.
    let lowest = std::os::fd::AsRawFd::as_raw_fd(&std::fs::File::open("/dev/null").unwrap());
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    // A descriptor number is small and not negative: it fits rlim_t (u64
    // on Linux, i64 on the BSDs).
    let soft = (lowest + n) as libc::rlim_t;
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("setrlimit");
}

/// Connects with room for one descriptor more, the socket's: the table's
/// descriptor, sent with the broker's answer, finds none. The client must
/// then take its tokens over the socket, at once.
fn one_descriptor_free() {
    leave_free(1);
    let start = std::time::Instant::now();
    let client = Client::from_env_with(Options::default().implicit_token(false))
        .expect("connect to the broker with one descriptor free");
    println!("role: {} after {:?}", client.token_path(), start.elapsed());
    for _ in 0..3 {
        drop(client.acquire().expect("acquire"));
    }
    println!("role: 3 tokens");
}

/// Connects with room for two descriptors more: the socket's, and the
/// table's while it is mapped. A client that closes the table's descriptor
/// once mapped has one free again afterwards.
fn two_descriptors_free() {
    leave_free(2);
    let client = Client::from_env_with(Options::default().implicit_token(false))
        .expect("connect to the broker with two descriptors free");
    println!("role: {}", client.token_path());
    match std::fs::File::open("/dev/null") {
        Ok(_) => println!("role: a descriptor is free after connecting"),
        Err(e) => println!("role: no descriptor free after connecting: {e}"),
    }
    for _ in 0..3 {
        drop(client.acquire().expect("acquire"));
    }
    println!("role: 3 tokens");
}

/// Processes registered in `held` that can still act: alive, with their
/// descriptors open.
fn live_holders(held: &Path) -> u32 {
    let mut n = 0;
    for entry in std::fs::read_dir(held).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // A killed process closes its descriptors (and so its connection,
        // which is when the broker takes its tokens back) before it turns
        // into a zombie: while it exits it may still look running. It
        // holds tokens only while it has descriptors open.
        let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0);
        if open_fds > 0 {
            n += 1;
        }
    }
    n
}

/// A process that takes and gives back tokens forever, from the table, or
/// over the socket when `socket` (`HERDLESS_FAST_PATH=0`).
fn churner(serve: &Serve, dir: &Path, socket: bool) -> Child {
    let mut cmd = common::helper_command();
    if socket {
        // Now and then: the table reopens in between, and each ask finds
        // waiters in it to move to the queue.
        cmd.env("HERDLESS_FAST_PATH", "0")
            .env("HERDLESS_FAST_TEST_PAUSE_US", "2000");
    }
    let mut child = cmd
        .env(ROLE, "churn")
        .env(DIR, dir)
        .env("HERDLESS_SOCKET", &serve.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn churner");
    // Wait until it is connected (it says which path it uses).
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = std::io::BufRead::read_line(&mut out, &mut line).expect("read churner");
        assert!(n > 0, "churner exited before connecting");
        if let Some(at) = line.find("role: ") {
            assert_eq!(
                line[at + 6..].trim(),
                if socket { "socket" } else { "shared table" },
                "the churner uses the path it was told to"
            );
            break;
        }
    }
    // Its stdout is not read again: it prints nothing more.
    std::mem::forget(out);
    child
}

/// A helper process holding `n` tokens of `serve`.
fn holder(serve: &Serve, n: u32) -> Helper {
    let mut h = Helper::spawn(&serve.socket, "hold", n);
    assert_eq!(h.line(), format!("held {n}"));
    h
}

/// Every client gone: all `free` shared tokens back in the pool, none
/// lost, and the broker stops cleanly. The last status and the broker's
/// log, for what a test checks besides.
fn all_back(serve: Serve, free: u32) -> (herdless::status::Status, String) {
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == free);
    assert_eq!(s.lost, 0, "{s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    (s, log)
}

/// The kills land at reproducible points for one seed, taken from the
/// clock and printed, to replay a failure.
fn seeded() -> Rng {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {seed}");
    Rng(seed)
}

#[test]
fn killing_table_clients_at_random_points_loses_and_duplicates_nothing() {
    // Fewer clients than tokens: nobody waits, the table stays open, and
    // the kills land in takes and give-backs from it.
    kill_churners(8, 5, "open");
    // More clients than tokens: they wait in the table, and kills land in
    // waits, in hand-offs between a giver's two steps and in give-backs.
    kill_churners(4, 6, "contended");
}

#[test]
fn killing_waiters_and_givers_in_a_crowded_table_loses_nothing() {
    // Many more clients than tokens: long lines of waiters in the table,
    // most tokens handed on rather than freed, and kills landing between
    // a giver's two steps and in woken waiters before they claim.
    kill_churners(3, 10, "crowded");
}

#[test]
fn moves_to_the_queue_racing_hand_offs_and_kills_lose_nothing() {
    // One client kept to the socket asks now and then: each ask closes the
    // table and moves its waiters to the broker's queue, racing hand-offs
    // and kills.
    kill_mixed_churners(6, 8, 1, "mixed");
}

fn kill_churners(jobs: u32, churners: usize, name: &str) {
    kill_mixed_churners(jobs, churners, 0, name);
}

/// The pids that recorded a take in `peaks` from line `from` on.
fn takers_since(peaks: &str, from: usize) -> std::collections::HashSet<u32> {
    peaks
        .lines()
        .skip(from)
        .filter_map(|l| l.split(' ').nth(1)?.parse().ok())
        .collect()
}

/// Waits until every one of `pids` has recorded a take in `DIR/peaks`
/// after this call: no wait sleeps on while a token is free, none was left
/// in a gift to a dead client, none is held by nobody.
fn await_every_one_served(serve: &Serve, dir: &Path, pids: &[u32], what: &str) {
    let from = std::fs::read_to_string(dir.join("peaks"))
        .unwrap()
        .lines()
        .count();
    let start = Instant::now();
    loop {
        let peaks = std::fs::read_to_string(dir.join("peaks")).unwrap();
        let served = takers_since(&peaks, from);
        if pids.iter().all(|p| served.contains(p)) {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "{what}: never served: {:?} of {pids:?}; {:#?}",
            pids.iter()
                .filter(|p| !served.contains(p))
                .collect::<Vec<_>>(),
            serve.status()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The most shared tokens the churners recorded holding at once.
fn most_at_once(dir: &Path) -> u32 {
    std::fs::read_to_string(dir.join("peaks"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').next()?.parse::<u32>().ok())
        .max()
        .unwrap_or(0)
}

/// `churners` processes, the first `socket` of them kept to the socket,
/// killed at random points and replaced, 200 times.
fn kill_mixed_churners(jobs: u32, churners: usize, socket: usize, name: &str) {
    let serve = Serve::start(jobs);
    let dir = tempfile_dir(&format!("fast-kill-{name}"));
    std::fs::create_dir_all(dir.join("held")).unwrap();
    std::fs::write(dir.join("peaks"), b"").unwrap();
    let mut rng = seeded();
    let mut workers: Vec<Child> = (0..churners)
        .map(|i| churner(&serve, &dir, i < socket))
        .collect();
    let mut kills = 0;
    let start = Instant::now();
    while kills < 200 && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_micros(rng.next() % 3000));
        let i = (rng.next() % workers.len() as u64) as usize;
        let mut victim = std::mem::replace(&mut workers[i], churner(&serve, &dir, i < socket));
        victim.kill().unwrap();
        victim.wait().unwrap();
        kills += 1;
    }
    let mid = serve.status();
    let fast = mid.fast.clone().expect("the broker has a table");
    assert!(
        fast.grants > 0,
        "tokens were taken from the table: {mid:#?}"
    );
    assert!(fast.handoff, "clients may wait in the table: {mid:#?}");
    if churners as u32 >= jobs {
        assert!(mid.wakeups > 0, "tokens were handed to waiters: {mid:#?}");
    }
    // After all those kills, every churner alive now still gets a token.
    let pids: Vec<u32> = workers.iter().map(Child::id).collect();
    await_every_one_served(&serve, &dir, &pids, "churners after the kills");
    for mut w in workers {
        w.kill().unwrap();
        w.wait().unwrap();
    }
    let s = serve.wait_for("every client gone", |s| s.clients.is_empty());
    assert_eq!(s.free, s.capacity, "every token is free again: {s:#?}");
    assert_eq!(s.lost, 0, "{s:#?}");
    assert!(s.max_in_use <= jobs, "at most N in use: {s:#?}");
    let fast = s.fast.clone().expect("a table");
    assert_eq!(fast.held, 0, "{s:#?}");
    assert_eq!(fast.waiting, 0, "{s:#?}");
    assert_eq!(s.waiting, 0, "{s:#?}");
    assert_eq!(fast.cut_off, 0, "no honest client is cut off: {s:#?}");
    assert!(s.reclaimed > 0, "kills landed on holders: {s:#?}");
    eprintln!(
        "{name}: {kills} kills, {} taken back ({} from the table), {} table grants, \
         {} hand-offs, {} moved",
        s.reclaimed, fast.reclaimed, fast.grants, s.wakeups, fast.moved
    );
    let peaks = std::fs::read_to_string(dir.join("peaks")).unwrap();
    let most = most_at_once(&dir);
    let held: Vec<_> = std::fs::read_dir(dir.join("held"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        most < jobs,
        "at most {} shared tokens held at once, saw {most}; registered: {held:?}; {}",
        jobs - 1,
        &peaks[..peaks.len().min(2000)]
    );
    assert!(peaks.lines().count() > 100, "the churners made progress");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_socket_waiter_is_served_from_the_table_in_fifo_order() {
    // -j 3: two shared tokens, both lent to the table while nobody waits.
    let serve = Serve::start(3);
    let mut a = holder(&serve, 2);
    // From the table or over the socket, whichever the race at its
    // connection gave: two held.
    let s = serve.status();
    assert_eq!(s.clients[0].held, 2, "{s:#?}");
    let mut waiters: Vec<Helper> = (0..3u32)
        .map(|i| {
            let mut w = Helper::spawn(&serve.socket, "acquire", 1);
            assert_eq!(w.line(), "waiting");
            serve.wait_for("one more waiter", |s| s.waiting == i + 1);
            w
        })
        .collect();
    serve.wait_for("3 waiters", |s| s.waiting == 3);
    // The holder of both leaves: the first two waiters get them, in order.
    drop(a.stdin.take());
    assert_eq!(waiters[0].line(), "got");
    assert_eq!(waiters[1].line(), "got");
    let s = serve.wait_for("one waiter left", |s| s.waiting == 1);
    assert_eq!(s.free, 0);
    // The first leaves: the third is served.
    let w0 = waiters.remove(0);
    w0.finish();
    assert_eq!(waiters[1].line(), "got");
    for w in waiters {
        w.finish();
    }
    a.finish();
    let (s, log) = all_back(serve, 2);
    assert_eq!(s.reclaimed, 0);
    assert!(log.contains("tokens lost   0"), "{log}");
}

#[test]
fn a_client_told_to_keep_to_the_socket_does() {
    let serve = Serve::start(3);
    let out = common::helper_command()
        .env(ROLE, "churn")
        .env(DIR, "/nonexistent")
        .env("HERDLESS_SOCKET", &serve.socket)
        .env("HERDLESS_FAST_PATH", "0")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    // It panics on the missing directory, after saying which path it uses.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("role: socket"), "{text}");
    let s = serve.status();
    assert_eq!(s.fast.map(|f| f.grants), Some(0));
    let _ = serve.stop();
    let _ = PATIENCE;
}

/// Runs a helper in `role` against `serve`, which must succeed: its
/// standard output.
fn run_role(serve: &Serve, role: &str) -> String {
    let mut cmd = common::helper_command();
    cmd.env(ROLE, role)
        .env("HERDLESS_SOCKET", &serve.socket)
        .stdin(Stdio::null());
    let out = common::output_within(&mut cmd, PATIENCE);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn a_client_with_no_room_for_the_tables_descriptor_keeps_to_the_socket() {
    // The kernel drops a descriptor sent to a process whose table is full
    // and marks the message truncated; the bytes with it still come. The
    // client must read the broker's answer, keep to the socket, and work.
    let serve = Serve::start(3);
    let text = run_role(&serve, "one-descriptor-free");
    assert!(text.contains("role: socket after"), "{text}");
    assert!(text.contains("role: 3 tokens"), "{text}");
    let s = serve.status();
    assert_eq!(s.lost, 0, "{s:#?}");
    assert_eq!(s.in_use, 0, "{s:#?}");
    let _ = serve.stop();
}

#[test]
fn a_client_of_the_table_keeps_no_descriptor_for_it() {
    // The mapping keeps the table's memory file: the client closes the
    // descriptor it came with, and has it for its own work.
    let serve = Serve::start(3);
    let text = run_role(&serve, "two-descriptors-free");
    if cfg!(target_os = "linux") {
        assert!(text.contains("role: shared table"), "{text}");
    }
    assert!(
        text.contains("role: a descriptor is free after connecting"),
        "{text}"
    );
    assert!(text.contains("role: 3 tokens"), "{text}");
    let s = serve.status();
    if cfg!(target_os = "linux") {
        assert_eq!(s.fast.as_ref().map(|f| f.grants), Some(3), "{s:#?}");
    }
    assert_eq!(s.lost, 0, "{s:#?}");
    assert_eq!(s.in_use, 0, "{s:#?}");
    let _ = serve.stop();
}

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("herdless-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A client of the table that breaks its rules: reads the broker's table
/// like any client, then writes what it likes into it.
struct Hostile {
    stream: std::os::unix::net::UnixStream,
    table: herdless::fast::Table,
    owner: u32,
}

impl Hostile {
    fn connect(socket: &Path) -> Hostile {
        Hostile::connect_as(socket, herdless::protocol::HelloFlags::empty())
    }

    /// Connects with `flags` besides `FAST` (a job names the top's slot).
    fn connect_as(socket: &Path, flags: herdless::protocol::HelloFlags) -> Hostile {
        use herdless::protocol::{decode_reply, HelloFlags, Reply, Request, FAST_VERSION};
        use std::os::fd::AsFd;
        let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
        let mut hello = Vec::new();
        Request::Hello {
            version: FAST_VERSION,
            flags: flags | HelloFlags::FAST,
            pid: std::process::id(),
            slot: 0,
        }
        .encode(&mut hello);
        stream.write_all(&hello).unwrap();
        let mut got = Vec::new();
        let mut fd = None;
        loop {
            let mut buf = [0u8; 256];
            let (n, f) = herdless_platform::recv_with_fd(stream.as_fd(), &mut buf).unwrap();
            assert!(n > 0, "the broker closed the connection");
            got.extend_from_slice(&buf[..n]);
            fd = fd.or(f);
            let Ok(Some((Reply::Welcome { .. }, used))) = decode_reply(&got) else {
                continue;
            };
            if let Ok(Some((Reply::Segment { owner, words }, _))) = decode_reply(&got[used..]) {
                let table = herdless::fast::Table::open(fd.expect("the table's descriptor"), words)
                    .expect("map the table");
                return Hostile {
                    stream,
                    table,
                    owner,
                };
            }
        }
    }

    /// Takes a token over the socket (`TryAcquire`): the broker takes a
    /// free word back out of the table for it.
    fn try_acquire_by_socket(&mut self) -> bool {
        use herdless::protocol::{decode_reply, Reply, Request};
        use std::io::Read;
        let mut frame = Vec::new();
        Request::TryAcquire.encode(&mut frame);
        if self.stream.write_all(&frame).is_err() {
            return false;
        }
        let mut got = Vec::new();
        loop {
            let mut buf = [0u8; 64];
            let n = self.stream.read(&mut buf).unwrap_or(0);
            if n == 0 {
                // Cut off (a scribbler is).
                return false;
            }
            got.extend_from_slice(&buf[..n]);
            match decode_reply(&got) {
                Ok(Some((Reply::Grant, _))) => return true,
                Ok(Some((Reply::Denied, _))) => return false,
                Ok(Some((Reply::Error { .. }, _))) => return false,
                Ok(None) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// Asks the broker to look at the table (`Returned`).
    fn poke(&mut self) {
        let mut frame = Vec::new();
        herdless::protocol::Request::Returned.encode(&mut frame);
        let _ = self.stream.write_all(&frame);
    }
}

#[test]
fn a_hostile_table_client_gets_no_extra_token_and_is_cut_off() {
    use std::sync::atomic::Ordering::SeqCst;
    // -j 3: two shared tokens.
    let serve = Serve::start(3);
    let honest = holder(&serve, 1);
    let mut bad = Hostile::connect(&serve.socket);
    // The other token, over the socket: its word goes back out of the
    // table.
    assert!(bad.try_acquire_by_socket());
    let words = bad.table.words();
    // Garbage owners in every lent word it can see free, and its own id in
    // every word the broker never lent.
    for i in 0..words {
        let w = bad.table.word(i);
        match w.load(SeqCst) {
            herdless::fast::FREE => w.store(0x7777_0000, SeqCst),
            herdless::fast::OUT => w.store(bad.owner, SeqCst),
            _ => {}
        }
    }
    bad.poke();
    let s = serve.wait_for("the hostile client cut off", |s| {
        s.fast.as_ref().is_some_and(|f| f.cut_off == 1)
    });
    assert_eq!(s.lost, 0, "{s:#?}");
    assert_eq!(s.clients.len(), 1, "only the honest client is left: {s:#?}");
    assert_eq!(s.clients[0].held, 1, "{s:#?}");
    // Exactly the one other token can still be had, and no more.
    let c = Client::connect_with(&serve.socket, Options::default().implicit_token(false))
        .expect("connect");
    let one = c.try_acquire().expect("try").expect("the free token");
    assert!(c.try_acquire().expect("try").is_none(), "no third token");
    drop(one);
    drop(c);
    honest.finish();
    let (s, log) = all_back(serve, 2);
    assert!(s.max_in_use <= 3, "{s:#?}");
    assert!(log.contains("tokens lost   0"), "{log}");
    assert!(log.contains("cut off"), "{log}");
}

/// A job of the top names the top's slot, which is free: the table is
/// closed before the job can see it (the first take must ask the broker,
/// which lends the slot), not after its descriptor was sent. A job that
/// took a shared word first would keep the top's slot idle and a shared
/// token from the runners.
#[test]
fn a_job_naming_a_free_slot_never_sees_the_table_open() {
    let serve = Serve::start(4);
    let runner = Client::connect_with(&serve.socket, Options::default().implicit_token(false))
        .expect("connect");
    let mut open = 0;
    for _ in 0..300 {
        let job = Hostile::connect_as(&serve.socket, herdless::protocol::HelloFlags::JOB);
        if job.table.take(job.owner, 0).is_some() {
            open += 1;
        }
        drop(job);
        serve.wait_for("the job's connection gone", |s| s.clients.len() == 1);
    }
    assert_eq!(
        open, 0,
        "times a job took a shared word while its slot was free"
    );
    drop(runner);
    let (s, log) = all_back(serve, 3);
    assert_eq!(s.lost, 0, "{s:#?}");
    assert!(log.contains("tokens lost   0"), "{log}");
}

#[test]
fn a_broker_that_predates_the_table_is_asked_again_without_it() {
    use herdless::protocol::{decode_request, HelloFlags, Reply, Request, PROTOCOL_VERSION};
    use std::io::Read;
    let dir = tempfile_dir("old-broker");
    let socket = dir.join("broker.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let old = std::thread::spawn(move || {
        let mut hellos = Vec::new();
        for answer in 0..2 {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let hello = loop {
                let mut buf = [0u8; 64];
                let n = s.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
                if let Ok(Some((req, _))) = decode_request(&got) {
                    break req;
                }
                assert!(n > 0);
            };
            let Request::Hello { version, flags, .. } = hello else {
                panic!("not a hello");
            };
            hellos.push((version, flags));
            let mut out = Vec::new();
            if answer == 0 {
                // What a version 3 broker's decoder says to the flag.
                Reply::Error {
                    message: "malformed frame: hello has unknown flag bits 0x08".into(),
                }
                .encode(&mut out);
                s.write_all(&out).unwrap();
            } else {
                Reply::Welcome {
                    version: PROTOCOL_VERSION,
                    capacity: 3,
                    client_id: 1,
                    slot: 9,
                }
                .encode(&mut out);
                s.write_all(&out).unwrap();
                // Keep the connection until the client has looked.
                let _ = s.read(&mut [0u8; 1]);
            }
        }
        hellos
    });
    let c = Client::connect_with(&socket, Options::default().implicit_token(false))
        .expect("connected the second time");
    assert_eq!(c.token_path(), "socket");
    assert_eq!(c.capacity(), Some(3));
    drop(c);
    let hellos = old.join().unwrap();
    assert!(hellos[0].1.contains(HelloFlags::FAST), "{hellos:?}");
    assert_eq!(hellos[0].0, herdless::protocol::TAKE_BACK_VERSION);
    assert_eq!(hellos[1], (PROTOCOL_VERSION, HelloFlags::empty()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cap_counts_what_a_subtree_holds_from_the_table() {
    // -j 5: four shared tokens, lent to the table while nobody waits.
    let serve = Serve::start(5);
    let mut a = holder(&serve, 3);
    let s = serve.status();
    assert_eq!(s.fast.as_ref().map(|f| f.held), Some(3), "{s:#?}");
    // Every helper descends from this process: cap its subtree at 3.
    let ctl = Client::control(&serve.socket).expect("control");
    ctl.cap(std::process::id(), Some(3)).expect("cap");
    let mut w = Helper::spawn(&serve.socket, "acquire", 1);
    assert_eq!(w.line(), "waiting");
    let s = serve.wait_for("the capped waiter queued", |s| s.waiting == 1);
    assert_eq!(s.free, 1, "one token free, held back by the cap: {s:#?}");
    let caps = s.controls.clone().expect("controls").caps;
    assert_eq!(caps.len(), 1);
    assert_eq!(caps[0].held, 3, "the table's tokens count: {s:#?}");
    // One of the three back: the waiter may have one.
    drop(a.stdin.take());
    assert_eq!(w.line(), "got");
    a.finish();
    w.finish();
    ctl.cap(std::process::id(), None).expect("uncap");
    all_back(serve, 4);
}

/// Writes values, meaningful and random, into a third of every word of
/// the table a client can map: token words, slots, figures and header.
fn scribble(table: &herdless::fast::Table, rng: &mut Rng, values: &[u32]) {
    use std::sync::atomic::Ordering::SeqCst;
    let mut i = 0;
    while let Some(w) = table.raw_word(i) {
        if rng.next() % 3 == 0 {
            let v = match rng.next() % 4 {
                0 => values[(rng.next() % values.len() as u64) as usize],
                1 => rng.next() as u32,
                2 => w.load(SeqCst) ^ (1 << (rng.next() % 32)),
                _ => w.load(SeqCst),
            };
            w.store(v, SeqCst);
        }
        i += 1;
    }
}

#[test]
fn a_client_scribbling_over_the_whole_table_cannot_crash_the_broker_or_overdraw_it() {
    // -j 4: three shared tokens. Honest clients keep to the socket (a
    // scribbler can stall clients of the table, whose words it owns as
    // much as they do, but not the broker's pool).
    let jobs = 4;
    let serve = Serve::start(jobs);
    let dir = tempfile_dir("fast-scribble");
    std::fs::create_dir_all(dir.join("held")).unwrap();
    std::fs::write(dir.join("peaks"), b"").unwrap();
    let mut honest: Vec<Child> = (0..4).map(|_| churner(&serve, &dir, true)).collect();
    let mut rng = seeded();
    let mut rounds = 0;
    let mut scribblers = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(4) {
        let mut bad = Hostile::connect(&serve.socket);
        scribblers += 1;
        // Values that mean something: free, out, ids near its own, gifts
        // between them, claimed tickets, the guard's id with its bits.
        let tid = bad
            .table
            .raw_word(bad.table.total() + 10)
            .map_or(0, |w| w.load(std::sync::atomic::Ordering::SeqCst));
        let o = bad.owner;
        let values = [
            herdless::fast::FREE,
            herdless::fast::OUT,
            o,
            o + 1,
            herdless::fast::gift(o, o + 1),
            herdless::fast::gift(o + 1, o),
            herdless::fast::gift(herdless::fast::BROKER_GIVER, o),
            0x8000_0000 | o,
            0x8000_7ffd,
            0x8000_7ffe,
            tid,
            tid | 0x8000_0000,
            tid | 0xc000_0000,
            0x4000_0000,
        ];
        for _ in 0..20 {
            scribble(&bad.table, &mut rng, &values);
            bad.poke();
            if rng.next() % 4 == 0 {
                let _ = bad.try_acquire_by_socket();
            }
            rounds += 1;
        }
        // The broker still answers, and never counts more than N in use.
        let s = match Client::observe(&serve.socket).and_then(|o| o.json()) {
            Ok(json) => serde_json::from_str::<herdless::status::Status>(&json).expect("json"),
            Err(e) => {
                let (status, log) = serve.stop();
                panic!("the broker died ({e}): {status:?}\n{log}");
            }
        };
        assert!(s.max_in_use <= jobs, "at most N in use: {s:#?}");
        drop(bad);
    }
    // Once the scribblers are gone, everything comes back and the honest
    // clients go on being served.
    let pids: Vec<u32> = honest.iter().map(Child::id).collect();
    await_every_one_served(&serve, &dir, &pids, "honest clients after the scribbling");
    for w in &mut honest {
        w.kill().unwrap();
        w.wait().unwrap();
    }
    let s = serve.wait_for("every client gone, every token free", |s| {
        s.clients.is_empty() && s.free == s.capacity
    });
    assert_eq!(s.lost, 0, "{s:#?}");
    let most = most_at_once(&dir);
    assert!(
        most < jobs,
        "honest clients held at most {} shared tokens at once, saw {most}",
        jobs - 1
    );
    eprintln!("{scribblers} scribblers, {rounds} rounds");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
