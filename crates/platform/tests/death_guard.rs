//! A [`DeathGuard`] answers for its words however its process ends: a
//! process killed with SIGKILL gets every guarded word that names its
//! guard marked and its sleeper woken by the kernel, in another process
//! that sleeps on it; a dropped guard does the same itself. Words the
//! guard does not name, or that name another thread, are left alone.

#![cfg(target_os = "linux")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use herdless_platform::{
    recv_with_fd, send_with_fd, DeathGuard, Segment, FUTEX_OWNER_DIED, FUTEX_TID_MASK,
    FUTEX_WAITERS,
};

/// How long a test waits for what must happen before it calls it a hang.
const PATIENCE: Duration = Duration::from_secs(15);

const ROLE: &str = "HERDLESS_GUARD_TEST_ROLE";
const SOCKET: &str = "HERDLESS_GUARD_TEST_SOCKET";
const COUNT: &str = "HERDLESS_GUARD_TEST_COUNT";

/// The segment's size in table words.
const WORDS: u32 = 4200;

/// The `n` guarded words of a test: every other word (a guarded word is
/// 8-aligned in the mapping, and the header has an even number of words).
fn guarded(n: u32) -> Vec<u32> {
    (0..n).map(|k| 2 * k).collect()
}

/// An unguarded word, 8-aligned, after every guarded one.
fn unguarded(n: u32) -> u32 {
    2 * n + 2
}

/// The process that dies: makes a segment, guards `COUNT` words, marks
/// them as a broker marks a waiting client's state (the guard's id with
/// `FUTEX_WAITERS`), sends the segment over the socket and sleeps until
/// killed.
#[test]
fn helper_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    if role == "drop-segment-first" {
        // Safe code only: the segment goes first, then its guard.
        let seg = Segment::create(64).expect("segment");
        let guard = seg.guard(&[0]).expect("guard");
        seg.word(0).store(guard.tid() | FUTEX_WAITERS, SeqCst);
        drop(seg);
        drop(guard);
        println!("dropped");
        std::process::exit(0);
    }
    assert_eq!(role, "guard");
    let n: u32 = std::env::var(COUNT).unwrap().parse().unwrap();
    let seg = Segment::create(WORDS).expect("segment");
    let guard = seg.guard(&guarded(n)).expect("guard");
    let tid = guard.tid();
    for i in guarded(n) {
        seg.word(i).store(tid | FUTEX_WAITERS, SeqCst);
    }
    // Names the guard but is not guarded: the kernel leaves it.
    seg.word(unguarded(n)).store(tid | FUTEX_WAITERS, SeqCst);
    // Guarded, but names another thread: left too.
    seg.word(2).store(1 | FUTEX_WAITERS, SeqCst);
    let path = PathBuf::from(std::env::var_os(SOCKET).unwrap());
    let listener = UnixListener::bind(&path).expect("bind");
    println!("tid {tid}");
    std::io::stdout().flush().unwrap();
    let (conn, _) = listener.accept().expect("accept");
    send_with_fd(
        conn.as_fd(),
        b"s",
        seg.file().expect("the maker keeps its file"),
    )
    .expect("send the segment");
    // Until killed.
    let mut buf = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut buf);
    drop(guard);
    std::process::exit(0);
}

struct Guarded {
    child: Child,
    seg: Arc<Segment>,
    tid: u32,
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a guarding process over `n` words and maps its segment.
fn spawn_guard(n: u32) -> Guarded {
    let path = std::env::temp_dir().join(format!("herdless-guard-{}-{n}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut child = common::helper_command()
        .env(ROLE, "guard")
        .env(SOCKET, &path)
        .env(COUNT, n.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the guarding process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let tid = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the guarding process ended before it said its guard's id"
        );
        if let Some(at) = line.find("tid ") {
            break line[at + 4..].trim().parse::<u32>().unwrap();
        }
    };
    let conn = UnixStream::connect(&path).expect("connect");
    let _ = std::fs::remove_file(&path);
    let mut buf = [0u8; 8];
    let (_, fd) = recv_with_fd(conn.as_fd(), &mut buf).expect("receive the segment");
    let seg = Segment::open(fd.expect("a descriptor"), WORDS).expect("map the segment");
    assert_ne!(tid, 0);
    assert_eq!(tid & !FUTEX_TID_MASK, 0);
    Guarded {
        child,
        seg: Arc::new(seg),
        tid,
    }
}

/// Sleeps on word `i` while it holds `expected`, in a thread; the channel
/// says when the sleep ended, with the word's value then.
fn sleeper(seg: &Arc<Segment>, i: u32, expected: u32) -> mpsc::Receiver<u32> {
    let (tx, rx) = mpsc::channel();
    let seg = seg.clone();
    thread::spawn(move || {
        // No timeout: only a wake-up (or a changed word) ends it.
        while seg.word(i).load(SeqCst) == expected {
            match seg.wait_word_for(i, expected, None) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("futex wait: {e}"),
            }
        }
        let _ = tx.send(seg.word(i).load(SeqCst));
    });
    rx
}

fn kill_wakes_every_sleeper(n: u32, sleepers: &[u32]) {
    let g = spawn_guard(n);
    let waiting = g.tid | FUTEX_WAITERS;
    for i in guarded(n) {
        if i != 2 {
            assert_eq!(g.seg.word(i).load(SeqCst), waiting, "word {i}");
        }
    }
    let rxs: Vec<_> = sleepers
        .iter()
        .map(|&i| (i, sleeper(&g.seg, i, waiting)))
        .collect();
    let mut g = g;
    // SIGKILL: no code of the guarding process runs again; only the kernel
    // can end these sleeps.
    g.child.kill().unwrap();
    g.child.wait().unwrap();
    for (i, rx) in rxs {
        let v = rx
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|_| panic!("the sleeper on word {i} was never woken"));
        assert_eq!(v, FUTEX_WAITERS | FUTEX_OWNER_DIED, "word {i}");
    }
    // Every guarded word that named the guard is marked, slept on or not,
    // the last of the list too.
    for i in guarded(n) {
        let v = g.seg.word(i).load(SeqCst);
        if i == 2 {
            assert_eq!(v, 1 | FUTEX_WAITERS, "a word naming another thread");
        } else {
            assert_eq!(v, FUTEX_WAITERS | FUTEX_OWNER_DIED, "word {i} of {n}");
        }
    }
    assert_eq!(
        g.seg.word(unguarded(n)).load(SeqCst),
        waiting,
        "an unguarded word is left alone"
    );
}

#[test]
fn a_killed_guards_words_are_marked_and_their_sleepers_woken() {
    kill_wakes_every_sleeper(8, &[0, 4, 14]);
}

#[test]
fn a_killed_guard_of_the_most_words_marks_the_last_of_them() {
    // The table's count (1024 slots and slot 0), then the most a guard
    // takes: the kernel walks a list of at most 2048 entries.
    kill_wakes_every_sleeper(1025, &[0, 2048]);
    let most = DeathGuard::MAX_WORDS as u32;
    kill_wakes_every_sleeper(most, &[0, 2 * (most - 1)]);
}

#[test]
fn a_dropped_guard_marks_and_wakes_its_words() {
    let seg = Arc::new(Segment::create(64).unwrap());
    let guard = seg.guard(&[0, 2, 4]).unwrap();
    let tid = guard.tid();
    let waiting = tid | FUTEX_WAITERS;
    seg.word(0).store(waiting, SeqCst);
    // Names the guard without a sleeper: marked, no waiters bit.
    seg.word(2).store(tid, SeqCst);
    // Another thread's id: left.
    seg.word(4).store(7 | FUTEX_WAITERS, SeqCst);
    // Names the guard but unguarded: left.
    seg.word(6).store(waiting, SeqCst);
    let rx = sleeper(&seg, 0, waiting);
    drop(guard);
    let v = rx
        .recv_timeout(PATIENCE)
        .expect("the sleeper was never woken");
    assert_eq!(v, FUTEX_WAITERS | FUTEX_OWNER_DIED);
    assert_eq!(seg.word(2).load(SeqCst), FUTEX_OWNER_DIED);
    assert_eq!(seg.word(4).load(SeqCst), 7 | FUTEX_WAITERS);
    assert_eq!(seg.word(6).load(SeqCst), waiting);
}

#[test]
fn guards_one_after_another_in_one_process_each_answer_for_their_words() {
    // A guard puts back the C library's list when dropped: a second guard
    // (and a third) in the same process works as the first did.
    let seg = Arc::new(Segment::create(64).unwrap());
    for round in 0..3 {
        let guard = seg.guard(&[0]).unwrap();
        let waiting = guard.tid() | FUTEX_WAITERS;
        seg.word(0).store(waiting, SeqCst);
        let rx = sleeper(&seg, 0, waiting);
        drop(guard);
        let v = rx
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|_| panic!("round {round}: the sleeper was never woken"));
        assert_eq!(v, FUTEX_WAITERS | FUTEX_OWNER_DIED, "round {round}");
    }
}

#[test]
fn a_guard_refuses_words_it_cannot_watch() {
    let seg = Segment::create(64).unwrap();
    let kind = |words: &[u32]| seg.guard(words).map(|_| ()).unwrap_err().kind();
    assert_eq!(kind(&[1]), std::io::ErrorKind::InvalidInput, "unaligned");
    assert_eq!(
        kind(&[64]),
        std::io::ErrorKind::InvalidInput,
        "out of range"
    );
    let big = Segment::create(WORDS).unwrap();
    let too_many: Vec<u32> = (0..DeathGuard::MAX_WORDS as u32 + 1)
        .map(|k| 2 * k)
        .collect();
    let err = big.guard(&too_many).map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "too many");
}

/// `Segment::guard` is safe and its guard borrows nothing from the
/// segment, so safe code may drop the segment first; the guard's end then
/// writes to (and wakes) words of a mapping that is gone.
#[test]
fn a_guard_that_outlives_its_segment_touches_no_memory() {
    let out = common::helper_command()
        .env(ROLE, "drop-segment-first")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("dropped"),
        "{:?}",
        out.status
    );
}
