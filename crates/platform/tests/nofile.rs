//! `descriptors_free` and `DescriptorCount`: exact at the limit, and a
//! count kept open, where the kernel counts a process's descriptors, takes
//! none from its other threads.
//! Each check runs in a process of its own (this test binary run again
//! with a role), whose descriptor limit it lowers.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use herdless_platform::{descriptors_free, descriptors_free_by_opening, DescriptorCount};
use nix::sys::resource::{getrlimit, setrlimit, Resource};

const ROLE: &str = "HERDLESS_NOFILE_TEST_ROLE";

/// Leaves exactly `n` descriptors free: lowers the soft limit to 256,
/// fills the table with `/dev/null` and closes `n` of them again. The
/// rest stay open for the process's life.
// rlim_t is u64 on Linux and Apple systems, i64 on the BSDs.
#[allow(clippy::unnecessary_cast)]
fn leave_free(n: usize) {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 256, hard as libc::rlim_t).unwrap();
    let mut filled = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => filled.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("open: {e}"),
        }
    }
    assert!(filled.len() >= n, "fewer than {n} descriptors under 256");
    filled.truncate(filled.len() - n);
    std::mem::forget(filled);
}

#[test]
fn helper_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // Exactly 10 free: 10 fit, 11 do not, by each way of asking, and
        // asking leaves every one of them free.
        "exact" => {
            // A count kept open holds its descriptor from here on.
            let mut kept = DescriptorCount::new();
            // One open above the limit to come takes no room under it.
            let high = {
                use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
                let f = std::fs::File::open("/dev/null").unwrap();
                // SAFETY: a test; 300 is unused in this fresh process.
                let fd = unsafe { libc::dup2(f.as_raw_fd(), 300) };
                assert_eq!(fd, 300);
                // SAFETY: dup2 returned a new descriptor this owns.
                unsafe { OwnedFd::from_raw_fd(fd) }
            };
            leave_free(10);
            let mut kept = |n| kept.free(n);
            let checks: [&mut dyn FnMut(usize) -> bool; 3] = [
                &mut descriptors_free,
                &mut descriptors_free_by_opening,
                &mut kept,
            ];
            for check in checks {
                assert!(check(10), "10 of 10 free");
                assert!(!check(11), "11 of 10 free");
                assert!(check(1));
            }
            let held: Vec<_> = (0..10)
                .map(|_| std::fs::File::open("/dev/null").expect("all 10 still free"))
                .collect();
            assert!(!descriptors_free(1), "none free");
            drop(held);
            drop(high);
            println!("ok");
        }
        // One free: another thread opens and closes a descriptor over and
        // over while this one asks whether one is free. Counts the opens
        // that found the table full.
        "concurrent" => {
            let mut kept = DescriptorCount::new();
            leave_free(1);
            let stop = Arc::new(AtomicBool::new(false));
            let failed = Arc::new(AtomicU64::new(0));
            let opener = {
                let (stop, failed) = (stop.clone(), failed.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if std::fs::File::open("/dev/null").is_err() {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            };
            let by_opening = std::env::var_os("HERDLESS_NOFILE_BY_OPENING").is_some();
            let end = Instant::now() + Duration::from_millis(300);
            while Instant::now() < end {
                if by_opening {
                    descriptors_free_by_opening(1);
                } else {
                    kept.free(1);
                }
            }
            stop.store(true, Ordering::Relaxed);
            opener.join().unwrap();
            println!("failed {}", failed.load(Ordering::Relaxed));
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

fn run_role(role: &str, env: &[(&str, &str)]) -> String {
    let out = common::helper_command()
        .env(ROLE, role)
        .envs(env.iter().copied())
        .output()
        .expect("run the helper");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{role}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn failed_opens(stdout: &str) -> u64 {
    let at = stdout.find("failed ").expect("the helper's count") + "failed ".len();
    stdout[at..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a count")
}

#[test]
fn descriptors_free_is_exact_at_the_limit() {
    assert!(run_role("exact", &[]).contains("ok"));
}

/// Where the kernel counts descriptors, asking a count kept open takes
/// none: a thread that opens the one free descriptor never finds it taken
/// by the check.
/// Opening them to count (the fallback) does take it, which the same
/// run shows, so the check can tell the two apart.
#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
#[test]
fn asking_takes_no_descriptor_from_another_thread() {
    assert_eq!(failed_opens(&run_role("concurrent", &[])), 0);
    assert!(
        failed_opens(&run_role(
            "concurrent",
            &[("HERDLESS_NOFILE_BY_OPENING", "1")]
        )) > 0,
        "opening to count never got in the other thread's way: the check above proves nothing"
    );
}
