//! Waiting in the shared token table (ARCHITECTURE §3, "The fast path")
//! with real processes: every wait there ends when the broker is killed
//! with SIGKILL, waits in the table come before a socket client's ask
//! that closes it, status counts them, and a broker told not to let
//! clients wait there keeps them at its queue.

mod common;

use std::collections::BTreeMap;
use std::io::BufReader;
use std::process::Stdio;

use common::{Helper, Serve, PATIENCE};

const SPIN: &str = "HERDLESS_HANDOFF_TEST_SPIN";
/// As [`SPIN`], but waiting in a poll loop (`request_grant`, then
/// `poll(2)` on the client's descriptor) with the poll-loop hand-off on.
const POLL_SPIN: &str = "HERDLESS_HANDOFF_TEST_POLL_SPIN";
const FILL_FDS: &str = "HERDLESS_HANDOFF_TEST_FILL_FDS";
/// Waits for one token in a poll loop with the poll-loop hand-off on,
/// counting the returns of `poll(2)` until the token came, then holds it
/// until its standard input closes.
const POLL_ONCE: &str = "HERDLESS_HANDOFF_TEST_POLL_ONCE";

#[test]
fn helper_process() {
    common::helper_main();
    // Takes and gives back this many tokens as fast as it can, then exits.
    if let Some(n) = std::env::var(SPIN).ok().and_then(|n| n.parse::<u32>().ok()) {
        let client = herdless::client::Client::from_env_with(
            herdless::client::Options::default().implicit_token(false),
        )
        .expect("connect to the broker");
        println!("role: {}", client.token_path());
        for _ in 0..n {
            let t = client.acquire().expect("acquire");
            // Held a moment, so the others wait in the table meanwhile.
            std::thread::sleep(std::time::Duration::from_micros(50));
            drop(t);
        }
        println!("role: done");
        std::process::exit(0);
    }
    if let Some(n) = std::env::var(POLL_SPIN)
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
    {
        use std::os::fd::AsFd;
        let client = herdless::client::Client::from_env_with(
            herdless::client::Options::default().implicit_token(false),
        )
        .expect("connect to the broker");
        // With FILL_FDS the descriptor table is full first: no eventfd or
        // epoll descriptor can be made, and the hand-off is refused.
        let _filler = std::env::var_os(FILL_FDS).map(|_| fill_fd_table(&client));
        match client.enable_poll_handoff() {
            Ok(on) => println!("role: poll hand-off {}", if on { "on" } else { "off" }),
            Err(e) if std::env::var_os(FILL_FDS).is_some() => {
                println!("role: poll hand-off refused: {e}");
            }
            Err(e) => panic!("poll hand-off: {e}"),
        }
        let mut polls = 0u64;
        for _ in 0..n {
            let t = loop {
                if let Some(t) = client.request_grant().expect("request a grant") {
                    break t;
                }
                let mut fds = [nix::poll::PollFd::new(
                    client.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => polls += 1,
                    Err(e) => panic!("poll: {e}"),
                }
            };
            std::thread::sleep(std::time::Duration::from_micros(50));
            drop(t);
        }
        println!("role: done after {polls} polls");
        std::process::exit(0);
    }
    if std::env::var_os(POLL_ONCE).is_some() {
        use std::io::Read;
        use std::os::fd::AsFd;
        let client = herdless::client::Client::from_env_with(
            herdless::client::Options::default().implicit_token(false),
        )
        .expect("connect to the broker");
        let on = client.enable_poll_handoff().expect("poll hand-off");
        println!("role: poll hand-off {}", if on { "on" } else { "off" });
        let mut polls = 0u64;
        let mut said = false;
        let t = loop {
            if let Some(t) = client.request_grant().expect("request a grant") {
                break t;
            }
            if !said {
                println!("role: waiting");
                said = true;
            }
            let mut fds = [nix::poll::PollFd::new(
                client.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => polls += 1,
                Err(e) => panic!("poll: {e}"),
            }
        };
        println!("role: got after {polls} polls");
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        drop(t);
        std::process::exit(0);
    }
}

/// Fills this process's descriptor table (a soft limit of 64, then
/// duplicates of the client's descriptor until `EMFILE`); the duplicates
/// are returned, to keep.
fn fill_fd_table(client: &herdless::client::Client) -> Vec<std::os::fd::OwnedFd> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    use std::os::fd::AsFd;
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, 64.min(hard), hard).expect("setrlimit");
    let mut fds = Vec::new();
    loop {
        match client.as_fd().try_clone_to_owned() {
            Ok(fd) => fds.push(fd),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => return fds,
            Err(e) => panic!("dup: {e}"),
        }
    }
}

/// A helper process holding `n` tokens of `serve`.
fn holder(serve: &Serve, n: u32) -> Helper {
    let mut h = Helper::spawn(&serve.socket, "hold", n);
    assert_eq!(h.line(), format!("held {n}"));
    h
}

/// `n` clients of the table that wait for a token, each started once the
/// one before waits (in the table when the broker lets them).
fn waiters(serve: &Serve, n: u32, in_table: bool) -> Vec<Helper> {
    (1..=n)
        .map(|i| {
            let mut w = Helper::spawn(&serve.socket, "acquire-report", 1);
            assert_eq!(w.line(), "waiting");
            let s = serve.wait_for("one more waiter", |s| s.waiting == i);
            let fast = s.fast.clone().expect("a table");
            if in_table {
                assert_eq!(fast.waiting, i, "waits in the table: {s:#?}");
                assert!(fast.handoff, "{s:#?}");
            } else {
                assert_eq!(fast.waiting, 0, "no wait in the table: {s:#?}");
                assert!(!fast.handoff, "{s:#?}");
            }
            w
        })
        .collect()
}

/// A client kept to the socket (`HERDLESS_FAST_PATH=0`) that waits for a
/// token.
fn socket_client(serve: &Serve) -> Helper {
    Helper::spawn_with(
        &serve.socket,
        "acquire-report",
        1,
        &[("HERDLESS_FAST_PATH", "0")],
    )
}

/// Which of `pids` hold a token now, as the broker counts.
fn holding(serve: &Serve, pids: &[u32]) -> BTreeMap<u32, u32> {
    serve
        .status()
        .clients
        .iter()
        .filter(|c| pids.contains(&c.pid) && c.held > 0)
        .map(|c| (c.pid, c.held))
        .collect()
}

#[test]
fn killing_the_broker_ends_every_wait_in_the_table() {
    // -j 3: two shared tokens, both held; eight clients wait in the table.
    let serve = Serve::start(3);
    let a = holder(&serve, 2);
    let s = serve.status();
    assert!(s.fast.as_ref().unwrap().open, "the table is open: {s:#?}");
    let mut ws = waiters(&serve, 8, true);
    let s = serve.status();
    assert_eq!(s.waiting, 8, "{s:#?}");
    // SIGKILL: the broker runs no code again; only the kernel, through
    // its guard's robust list, can wake these sleepers.
    let _log = serve.kill();
    for (i, w) in ws.iter_mut().enumerate() {
        let line = w.line();
        assert!(
            line.starts_with("error"),
            "waiter {i} was told {line:?} after the broker died"
        );
        let status = common::wait_timeout(&mut w.child, PATIENCE)
            .unwrap_or_else(|| panic!("waiter {i} did not exit"));
        assert_eq!(status.code(), Some(4), "waiter {i}");
    }
    // The holder is told nothing until it asks; it exits cleanly.
    a.finish();
}

#[test]
fn killing_the_broker_ends_waits_in_the_table_again_and_again() {
    // Broker deaths that land while waiters come and go: none hangs.
    for round in 0..4 {
        let serve = Serve::start(2);
        let a = holder(&serve, 1);
        let mut ws: Vec<Helper> = (0..5)
            .map(|_| Helper::spawn(&serve.socket, "acquire-report", 1))
            .collect();
        for w in &mut ws {
            assert_eq!(w.line(), "waiting");
        }
        // Some in the table already, some maybe still on their way.
        serve.wait_for("a waiter in the table", |s| {
            s.fast.as_ref().is_some_and(|f| f.waiting > round % 3)
        });
        let _ = serve.kill();
        for (i, mut w) in ws.into_iter().enumerate() {
            let line = w.line();
            assert!(
                line.starts_with("error"),
                "round {round}, waiter {i}: {line:?}"
            );
            w.finish();
        }
        a.finish();
    }
}

#[test]
fn a_socket_ask_queues_behind_the_waits_in_the_table() {
    // -j 3: two shared tokens, held by two clients of the table.
    let serve = Serve::start(3);
    let h1 = holder(&serve, 1);
    let h2 = holder(&serve, 1);
    let mut ws = waiters(&serve, 3, true);
    // A client kept off the table asks: the table closes, its three
    // waiters move to the queue in ticket order, and this ask comes after.
    let mut sock = socket_client(&serve);
    assert_eq!(sock.line(), "waiting");
    let s = serve.wait_for("four waiting at the broker", |s| {
        s.waiting == 4 && s.fast.as_ref().is_some_and(|f| f.waiting == 0)
    });
    assert_eq!(s.fast.as_ref().unwrap().moved, 3, "{s:#?}");
    let pids: Vec<u32> = ws.iter().map(Helper::pid).chain([sock.pid()]).collect();
    assert!(holding(&serve, &pids).is_empty());
    // Each release serves the next in line, and only it.
    h1.finish();
    assert_eq!(ws[0].line(), "got");
    let s = serve.wait_for("three waiting", |s| s.waiting == 3);
    assert_eq!(
        holding(&serve, &pids),
        BTreeMap::from([(pids[0], 1)]),
        "{s:#?}"
    );
    h2.finish();
    assert_eq!(ws[1].line(), "got");
    serve.wait_for("two waiting", |s| s.waiting == 2);
    assert_eq!(
        holding(&serve, &pids),
        BTreeMap::from([(pids[0], 1), (pids[1], 1)])
    );
    let w0 = ws.remove(0);
    w0.finish();
    assert_eq!(ws[1].line(), "got");
    serve.wait_for("one waiting", |s| s.waiting == 1);
    assert_eq!(
        holding(&serve, &pids),
        BTreeMap::from([(pids[1], 1), (pids[2], 1)])
    );
    let w1 = ws.remove(0);
    w1.finish();
    assert_eq!(sock.line(), "got");
    let s = serve.wait_for("nobody waiting", |s| s.waiting == 0);
    assert_eq!(
        holding(&serve, &pids),
        BTreeMap::from([(pids[2], 1), (pids[3], 1)]),
        "{s:#?}"
    );
    for w in ws {
        w.finish();
    }
    sock.finish();
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0, "{s:#?}");
    assert_eq!(s.reclaimed, 0, "{s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

/// A poll-loop waiter of [`POLL_ONCE`], and its output.
struct PollWaiter {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
}

impl PollWaiter {
    fn spawn(serve: &Serve) -> PollWaiter {
        let mut child = common::helper_command()
            .env(POLL_ONCE, "1")
            .env("HERDLESS_SOCKET", &serve.socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a poll-loop waiter");
        let out = BufReader::new(child.stdout.take().unwrap());
        PollWaiter { child, out }
    }

    /// What its next line says after `role: `.
    fn line(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = std::io::BufRead::read_line(&mut self.out, &mut line).unwrap();
            assert!(n > 0, "a poll-loop waiter ended early");
            // The test harness may print its own words before it.
            if let Some(at) = line.find("role: ") {
                return line[at + "role: ".len()..].trim_end().to_string();
            }
        }
    }

    /// Closes its input: it gives its token back and exits.
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = common::wait_timeout(&mut self.child, PATIENCE).expect("exit");
        assert!(status.success(), "{status:?}");
    }
}

#[test]
fn a_poll_loop_wait_moved_to_the_queue_wakes_only_for_its_grant() {
    // Three processes wait in their poll loops, in the table, for the two
    // shared tokens that two others hold. A client kept to the socket asks:
    // the table closes and the broker moves the three waits to its queue.
    // A poll loop watches the socket, where a moved wait's grant comes, so
    // the move itself must not wake it: each waiter's poll returns once,
    // for its grant, and the grants follow the tickets.
    let serve = Serve::start(3);
    let h1 = holder(&serve, 1);
    let h2 = holder(&serve, 1);
    let mut ws = Vec::new();
    for i in 1..=3 {
        let mut w = PollWaiter::spawn(&serve);
        assert_eq!(w.line(), "poll hand-off on");
        assert_eq!(w.line(), "waiting");
        serve.wait_for("one more waiter in the table", |s| {
            s.fast.as_ref().is_some_and(|f| f.waiting == i)
        });
        ws.push(w);
    }
    let mut sock = socket_client(&serve);
    assert_eq!(sock.line(), "waiting");
    let s = serve.wait_for("four waiting at the broker", |s| {
        s.waiting == 4 && s.fast.as_ref().is_some_and(|f| f.waiting == 0)
    });
    assert_eq!(s.fast.as_ref().unwrap().moved, 3, "{s:#?}");
    // Each release serves the next in line; a waiter's first poll return
    // is its grant.
    h1.finish();
    assert_eq!(ws[0].line(), "got after 1 polls");
    h2.finish();
    assert_eq!(ws[1].line(), "got after 1 polls");
    let mut ws = ws.into_iter();
    ws.next().unwrap().finish();
    let mut w3 = ws.next().map(|w2| (w2, ws.next().unwrap())).unwrap();
    assert_eq!(w3.1.line(), "got after 1 polls");
    w3.0.finish();
    assert_eq!(sock.line(), "got");
    w3.1.finish();
    sock.finish();
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0, "{s:#?}");
    assert!(s.max_in_use <= 2, "{s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn tokens_go_round_waiters_in_the_table_in_ticket_order() {
    // One shared token, six waiters in the table: each release hands it
    // to the oldest, without the broker's queue.
    let serve = Serve::start(2);
    let h = holder(&serve, 1);
    let mut ws = waiters(&serve, 6, true);
    let pids: Vec<u32> = ws.iter().map(Helper::pid).collect();
    h.finish();
    for k in 0..6 {
        assert_eq!(ws[0].line(), "got", "waiter {k}");
        serve.wait_for("the next served", |s| s.waiting == 5 - k as u32);
        assert_eq!(
            holding(&serve, &pids),
            BTreeMap::from([(pids[k], 1)]),
            "waiter {k} holds the only token"
        );
        ws.remove(0).finish();
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 1);
    assert_eq!(s.lost, 0, "{s:#?}");
    let fast = s.fast.clone().expect("a table");
    assert_eq!(fast.moved, 0, "nothing moved to the queue: {s:#?}");
    assert!(s.wakeups >= 6, "six hand-offs: {s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_broker_told_not_to_hand_off_keeps_waits_at_its_queue() {
    let serve = Serve::start_with(2, |c| {
        c.env("HERDLESS_HANDOFF", "0");
    });
    let h = holder(&serve, 1);
    let mut ws = waiters(&serve, 3, false);
    h.finish();
    assert_eq!(ws[0].line(), "got");
    for w in ws.drain(..) {
        w.finish();
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 1);
    assert_eq!(s.lost, 0, "{s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn givers_stopped_anywhere_leave_no_wait_hanging() {
    // Six clients spin on two tokens, so most releases hand a token to a
    // waiter in two steps; the test stops one of them (SIGSTOP) at random
    // points, now and then between those steps, while the others go on,
    // then lets it go on. Every client finishes its rounds: no wait in the
    // table, or at the broker after one, is left without its token.
    const ROUNDS: u32 = 1500;
    let serve = Serve::start(3);
    let mut spinners = spinners(
        &serve,
        6,
        &[(SPIN, ROUNDS.to_string())],
        "role: shared table",
    );
    let mut next = seeded_rng();
    let mut stops = 0;
    while spinners.iter_mut().any(|c| c.try_wait().unwrap().is_none()) && stops < 3000 {
        let c = &spinners[(next() % 6) as usize];
        let pid = c.id() as i32;
        common::signal(pid, libc::SIGSTOP);
        std::thread::sleep(std::time::Duration::from_micros(next() % 1500));
        common::signal(pid, libc::SIGCONT);
        stops += 1;
    }
    for (i, c) in spinners.iter_mut().enumerate() {
        common::signal(c.id() as i32, libc::SIGCONT);
        let status = common::wait_timeout(c, PATIENCE).unwrap_or_else(|| {
            panic!(
                "spinner {i} never finished its rounds (a wait that never ends); {:#?}",
                serve.status()
            )
        });
        assert!(status.success(), "spinner {i}: {status:?}");
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0, "{s:#?}");
    eprintln!(
        "{stops} stops; {} table grants, {} hand-offs, {} moved",
        s.fast.as_ref().map_or(0, |f| f.grants),
        s.wakeups,
        s.fast.as_ref().map_or(0, |f| f.moved)
    );
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

/// A xorshift generator seeded from the clock (the seed is printed, to
/// replay a failure).
fn seeded_rng() -> impl FnMut() -> u64 {
    let mut rng = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {rng}");
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

/// Starts `n` spinner processes with `env` set, each past its handshake
/// (its first line says how it connected, checked by `connected`).
fn spinners(
    serve: &Serve,
    n: usize,
    env: &[(&str, String)],
    connected: &str,
) -> Vec<std::process::Child> {
    (0..n)
        .map(|_| {
            let mut c = common::helper_command()
                .envs(env.iter().map(|(k, v)| (k, v)))
                .env("HERDLESS_SOCKET", &serve.socket)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn a spinner");
            let mut out = BufReader::new(c.stdout.take().unwrap());
            let mut line = String::new();
            while !line.contains("role: ") {
                line.clear();
                let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
                assert!(n > 0, "a spinner ended before it connected");
            }
            assert!(line.contains(connected), "{line:?}");
            std::mem::forget(out);
            c
        })
        .collect()
}

#[test]
fn poll_loops_hand_off_in_the_table_through_stops_and_kills() {
    // Six processes wait for two tokens in their own poll loops, with the
    // poll-loop hand-off on: a giver hands its token to the oldest waiter
    // in the table and signals that process, with no message to the
    // broker. The test stops them (SIGSTOP) at random points, between a
    // giver's steps now and then, and kills two of them (SIGKILL) midway,
    // whatever they are doing. The survivors finish every round (no wait
    // left without its token), the broker never counts more than two in
    // use, and every token comes back.
    const ROUNDS: u32 = 800;
    let serve = Serve::start(3);
    let mut procs = spinners(
        &serve,
        6,
        &[(POLL_SPIN, ROUNDS.to_string())],
        "role: poll hand-off on",
    );
    let mut next = seeded_rng();
    let mut stops = 0;
    let mut killed = Vec::new();
    while procs.iter_mut().any(|c| c.try_wait().unwrap().is_none()) && stops < 2000 {
        let i = (next() % 6) as usize;
        let pid = procs[i].id() as i32;
        common::signal(pid, libc::SIGSTOP);
        std::thread::sleep(std::time::Duration::from_micros(next() % 1500));
        if (stops == 200 || stops == 400) && !killed.contains(&i) {
            common::signal(pid, libc::SIGKILL);
            killed.push(i);
        } else {
            common::signal(pid, libc::SIGCONT);
        }
        stops += 1;
    }
    for (i, c) in procs.iter_mut().enumerate() {
        if !killed.contains(&i) {
            common::signal(c.id() as i32, libc::SIGCONT);
        }
        let status = common::wait_timeout(c, PATIENCE).unwrap_or_else(|| {
            panic!(
                "spinner {i} never finished its rounds (a wait that never ends); {:#?}",
                serve.status()
            )
        });
        if !killed.contains(&i) {
            assert!(status.success(), "spinner {i}: {status:?}");
        }
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0, "{s:#?}");
    assert!(s.max_in_use <= 2, "{s:#?}");
    let fast = s.fast.clone().expect("a table");
    // The rounds went through the table, and its hand-offs reached
    // processes asleep in poll.
    assert!(
        fast.grants >= u64::from(ROUNDS) * 4,
        "{} table grants for {} rounds: {s:#?}",
        fast.grants,
        ROUNDS * 4
    );
    assert!(s.wakeups > 0, "{s:#?}");
    eprintln!(
        "{stops} stops, {} killed; {} table grants, {} hand-offs, {} moved",
        killed.len(),
        fast.grants,
        s.wakeups,
        fast.moved
    );
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_poll_loop_with_no_descriptor_left_keeps_to_the_socket() {
    // Two poll-loop processes whose descriptor tables are full when they
    // turn the poll-loop hand-off on: it needs an eventfd and an epoll
    // descriptor, so it is refused with the OS's reason, and each process
    // goes on with its waits at the broker (its socket, already open).
    // They share one token for their rounds: every round ends, nothing is
    // lost, and no wait went through the table.
    const ROUNDS: u32 = 200;
    let serve = Serve::start(2);
    let mut procs = spinners(
        &serve,
        2,
        &[(POLL_SPIN, ROUNDS.to_string()), (FILL_FDS, "1".into())],
        "role: poll hand-off refused: set up wake-ups for a poll loop: Too many open files",
    );
    for c in &mut procs {
        let status = common::wait_timeout(c, PATIENCE).expect("a spinner never finished");
        assert!(status.success(), "{status:?}");
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 1);
    assert_eq!(s.lost, 0, "{s:#?}");
    assert!(s.max_in_use <= 1, "{s:#?}");
    // Both waited at the broker: no wait of theirs was ever in the table.
    assert!(s.waits > 0, "{s:#?}");
    assert_eq!(s.fast.as_ref().expect("a table").moved, 0, "{s:#?}");
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_stop_ends_every_wait_in_the_table_with_no_grant() {
    // -j 3: both shared tokens held; six clients wait in the table. A
    // SIGTERM closes the table: each wait moves to the broker, which
    // refuses it; nobody is granted a token after the stop, and the
    // holder's release during it is not handed to a waiter.
    let serve = Serve::start(3);
    let a = holder(&serve, 2);
    let mut ws = waiters(&serve, 6, true);
    common::signal(serve.pid(), libc::SIGTERM);
    for (i, w) in ws.iter_mut().enumerate() {
        let line = w.line();
        assert!(
            line.starts_with("error"),
            "waiter {i} was told {line:?} after the stop"
        );
    }
    a.finish();
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        common::stat(&log, "taken back"),
        "0 from clients that died holding them",
        "{log}"
    );
    for (i, mut w) in ws.into_iter().enumerate() {
        let status = common::wait_timeout(&mut w.child, PATIENCE)
            .unwrap_or_else(|| panic!("waiter {i} did not exit"));
        assert_eq!(status.code(), Some(4), "waiter {i}");
    }
}

#[test]
fn a_client_in_another_pid_namespace_keeps_to_the_socket() {
    // The process ids in the table's wake words, and the signals givers
    // send to them, mean other processes in another PID namespace: a
    // client there must not use the table. `unshare --pid` needs
    // privileges (CI runs as root); without them there is nothing to try.
    let serve = Serve::start(3);
    let run = |prefix: &[&str]| -> Option<String> {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = std::process::Command::new(prefix.first().copied().unwrap_or(""));
        let mut args: Vec<std::ffi::OsString> =
            prefix[1..].iter().map(std::ffi::OsString::from).collect();
        args.push(exe.into_os_string());
        args.extend(
            [
                "--exact",
                "helper_process",
                "--nocapture",
                "--test-threads=1",
            ]
            .iter()
            .map(std::ffi::OsString::from),
        );
        let out = cmd
            .args(args)
            .env(SPIN, "20")
            .env("HERDLESS_SOCKET", &serve.socket)
            .output()
            .ok()?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success().then_some(stdout)
    };
    // The same binary, in the broker's namespace, uses the table.
    let here = run(&["env"]).expect("a spinner");
    assert!(here.contains("role: shared table"), "{here}");
    let Some(there) = run(&["unshare", "--pid", "--fork"]) else {
        eprintln!("unshare --pid is not available here: nothing to try");
        return;
    };
    assert!(there.contains("role: socket"), "{there}");
    assert!(there.contains("role: done"), "{there}");
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0, "{s:#?}");
}
