//! A shared word hands each posted token to one taker, across two mappings
//! of the same file; a shared count is taken exactly once per unit, by
//! several processes at once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use herdless_platform::wait::Mode;
use herdless_platform::{SharedCount, SharedWord};

/// A fresh path in the temporary directory, removed on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(tag: &str) -> TempPath {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        TempPath(std::env::temp_dir().join(format!(
            "herdless-platform-{}-{tag}-{n}",
            std::process::id()
        )))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn supported() -> bool {
    match Mode::Futex.available() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("skipped: {why}");
            false
        }
    }
}

#[test]
fn create_open_and_count() {
    if !supported() {
        return;
    }
    let path = TempPath::new("count");
    let a = SharedWord::create(&path.0).unwrap();
    let b = SharedWord::open(&path.0).unwrap();
    assert_eq!(a.value(), 0);
    assert!(!b.try_take());
    a.post().unwrap();
    a.post().unwrap();
    assert_eq!(b.value(), 2);
    b.take().unwrap();
    assert!(a.try_take());
    assert!(!a.try_take());
    assert_eq!(b.value(), 0);
    let err = SharedWord::create(&path.0).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
}

#[test]
fn a_post_wakes_a_taker_on_the_other_mapping() {
    if !supported() {
        return;
    }
    let path = TempPath::new("wake");
    let poster = SharedWord::create(&path.0).unwrap();
    let taker = SharedWord::open(&path.0).unwrap();
    let t = thread::spawn(move || taker.take().unwrap());
    thread::sleep(Duration::from_millis(20));
    poster.post().unwrap();
    t.join().unwrap();
    assert_eq!(poster.value(), 0);
}

#[test]
fn every_token_reaches_one_taker() {
    if !supported() {
        return;
    }
    const TAKERS: usize = 4;
    const ROUNDS: usize = 200;
    let path = TempPath::new("many");
    let poster = SharedWord::create(&path.0).unwrap();
    let taken = Arc::new(AtomicU32::new(0));
    let takers: Vec<_> = (0..TAKERS)
        .map(|_| {
            let word = SharedWord::open(&path.0).unwrap();
            let taken = Arc::clone(&taken);
            thread::spawn(move || {
                for _ in 0..ROUNDS {
                    word.take().unwrap();
                    taken.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for _ in 0..TAKERS * ROUNDS {
        poster.post().unwrap();
    }
    for t in takers {
        t.join().unwrap();
    }
    assert_eq!(taken.load(Ordering::Relaxed) as usize, TAKERS * ROUNDS);
    assert_eq!(poster.value(), 0);
}

#[test]
fn short_files_are_refused() {
    if !supported() {
        return;
    }
    let path = TempPath::new("short");
    std::fs::write(&path.0, [0u8; 2]).unwrap();
    let err = SharedWord::open(&path.0).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
}

/// Set in the children of the shared-count test: the file to take from.
const COUNT_FILE: &str = "HERDLESS_TEST_SHARED_COUNT";
/// Set in the children of the shared-count test: a count of the children
/// not started yet, so that all of them take at once.
const GATE_FILE: &str = "HERDLESS_TEST_SHARED_GATE";

/// Marks this process started and spins until every other one is.
fn pass_gate(gate: &SharedCount) {
    assert!(gate.take_one(), "more processes than the gate counts");
    let start = std::time::Instant::now();
    while gate.value() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "a process of the test never started"
        );
        std::hint::spin_loop();
    }
}

/// Not a test on its own: in a child of
/// `a_count_is_taken_once_per_unit_by_several_processes`, takes from the
/// count until it is spent and prints how many it took.
#[test]
fn shared_count_child() {
    let Some(path) = std::env::var_os(COUNT_FILE) else {
        return;
    };
    let count = SharedCount::open(path).unwrap();
    let gate = SharedCount::open(std::env::var_os(GATE_FILE).unwrap()).unwrap();
    pass_gate(&gate);
    let (took, last) = take_all(&count);
    println!("took={took} last={}", u8::from(last));
}

/// Takes from `count` until it is spent: how many it took, and whether
/// it took the last one (the take that left 0).
fn take_all(count: &SharedCount) -> (u64, bool) {
    let mut took = 0u64;
    let mut last = false;
    while let Some(left) = count.take_one_left() {
        took += 1;
        last |= left == 0;
    }
    (took, last)
}

#[test]
fn a_count_is_taken_once_per_unit_by_several_processes() {
    const UNITS: u32 = 2_000_000;
    const CHILDREN: usize = 4;
    let path = TempPath::new("budget");
    let gate_path = TempPath::new("gate");
    let count = SharedCount::create(&path.0, UNITS).unwrap();
    let gate = SharedCount::create(&gate_path.0, CHILDREN as u32 + 1).unwrap();
    assert_eq!(count.value(), UNITS);
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "shared_count_child", "--nocapture"])
                .env(COUNT_FILE, &path.0)
                .env(GATE_FILE, &gate_path.0)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    pass_gate(&gate);
    let (mut took, last) = take_all(&count);
    let mut lasts = u32::from(last);
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("took="))
            .unwrap_or_else(|| panic!("no count from a child: {text}"));
        let (n, last) = line
            .split_once(" last=")
            .unwrap_or_else(|| panic!("no last from a child: {text}"));
        took += n.parse::<u64>().unwrap();
        lasts += last.parse::<u32>().unwrap();
    }
    assert_eq!(took, u64::from(UNITS));
    assert_eq!(lasts, 1, "exactly one process takes the last unit");
    assert_eq!(count.value(), 0);
    assert!(!count.take_one(), "a spent count stays at 0");
    let err = SharedCount::create(&path.0, 1).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
}
