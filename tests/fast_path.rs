//! The shared token table (the fast path, ARCHITECTURE §3) with real
//! processes: clients that take and give back tokens as fast as they can
//! are killed with SIGKILL at random points, over and over; no token is
//! lost or duplicated, at most N are held at once, and the broker counts
//! the table's grants.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Helper, Serve, PATIENCE};
use herdless::client::{Client, Options};

const ROLE: &str = "HERDLESS_FAST_TEST_ROLE";
const DIR: &str = "HERDLESS_FAST_TEST_DIR";

#[test]
fn helper_process() {
    common::helper_main();
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let client = Client::from_env_with(Options::default().implicit_token(false))
        .expect("connect to the broker");
    match role.as_str() {
        // Take and give back forever, recording in DIR/held how many live
        // processes hold a token at each take.
        "churn" => {
            println!("role: {}", client.token_path());
            let dir = PathBuf::from(std::env::var_os(DIR).expect("dir"));
            let me = std::process::id();
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
                    .write_all(format!("{n}\n").as_bytes())
                    .expect("record");
                std::fs::remove_file(&mine).expect("unregister");
                drop(t);
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// Processes registered in `held` that are still alive (not zombies).
fn live_holders(held: &Path) -> u32 {
    let mut n = 0;
    for entry in std::fs::read_dir(held).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next());
        if matches!(state, Some(s) if s != "Z" && s != "X") {
            n += 1;
        }
    }
    n
}

fn churner(serve: &Serve, dir: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_process",
            "--nocapture",
            "--test-threads=1",
        ])
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
                "shared table",
                "the churner uses the table"
            );
            break;
        }
    }
    // Its stdout is not read again: it prints nothing more.
    std::mem::forget(out);
    child
}

/// A small xorshift generator: the kills land at reproducible points for
/// one seed, and the seed is printed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn killing_table_clients_at_random_points_loses_and_duplicates_nothing() {
    let jobs = 4; // three shared tokens
    let serve = Serve::start(jobs);
    let dir = tempfile_dir("fast-kill");
    std::fs::create_dir_all(dir.join("held")).unwrap();
    std::fs::write(dir.join("peaks"), b"").unwrap();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {seed}");
    let mut rng = Rng(seed);
    let mut workers: Vec<Child> = (0..6).map(|_| churner(&serve, &dir)).collect();
    let mut kills = 0;
    let start = Instant::now();
    while kills < 150 && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_micros(rng.next() % 3000));
        let i = (rng.next() % workers.len() as u64) as usize;
        let mut victim = std::mem::replace(&mut workers[i], churner(&serve, &dir));
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
    assert_eq!(fast.cut_off, 0, "no honest client is cut off: {s:#?}");
    let peaks = std::fs::read_to_string(dir.join("peaks")).unwrap();
    let most = peaks
        .lines()
        .filter_map(|l| l.parse::<u32>().ok())
        .max()
        .unwrap_or(0);
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
    let mut a = Helper::spawn(&serve.socket, "hold", 2);
    assert_eq!(a.line(), "held 2");
    let s = serve.status();
    assert_eq!(s.fast.as_ref().map(|f| f.held), Some(2), "{s:#?}");
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
    let s = serve.wait_for("all free", |s| s.clients.is_empty() && s.free == 2);
    assert_eq!(s.lost, 0);
    assert_eq!(s.reclaimed, 0);
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
}

#[test]
fn a_client_told_to_keep_to_the_socket_does() {
    let serve = Serve::start(3);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_process",
            "--nocapture",
            "--test-threads=1",
        ])
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

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("herdless-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
