//! A shared word hands each posted token to one taker, across two mappings
//! of the same file.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use herdless_platform::wait::Mode;
use herdless_platform::SharedWord;

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
