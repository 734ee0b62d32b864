//! A signal interrupts wait_interruptible() and take_interruptible() with
//! an `Interrupted` error, while wait() and take() sleep on. Its own test
//! binary: it installs a process-wide signal handler.

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use herdless_platform::wait::{Mode, PipeWaiter, Woken};
use nix::sys::pthread::{pthread_kill, pthread_self, Pthread};
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

extern "C" fn ignore(_: nix::libc::c_int) {}

/// SIGUSR1 runs an empty handler without `SA_RESTART`, so that even a
/// blocking read() fails with `EINTR` instead of restarting.
fn install_handler() {
    let action = SigAction::new(
        SigHandler::Handler(ignore),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler does nothing, so it is async-signal-safe, and no
    // other code in this test binary handles SIGUSR1.
    unsafe { sigaction(Signal::SIGUSR1, &action) }.unwrap();
}

/// Signals `thread` until `done` is set: the first signal may land before
/// the thread starts to sleep.
fn pester(thread: Pthread, done: &AtomicBool) {
    while !done.load(Ordering::Acquire) {
        pthread_kill(thread, Signal::SIGUSR1).unwrap();
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn signals_interrupt_only_the_interruptible_waits() {
    install_handler();
    for mode in Mode::ALL {
        if mode == Mode::Futex || mode.available().is_err() {
            continue;
        }
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut waiter = PipeWaiter::new(r.as_fd(), mode).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let t = {
            let done = Arc::clone(&done);
            thread::spawn(move || {
                tx.send(pthread_self()).unwrap();
                let err = waiter.wait_interruptible().unwrap_err();
                done.store(true, Ordering::Release);
                assert_eq!(err.kind(), io::ErrorKind::Interrupted, "{mode}");
                // wait() sleeps through signals until the byte comes.
                let woken = waiter.wait().unwrap();
                let byte = match woken {
                    Woken::Claimed(b) => b,
                    other => loop {
                        assert_eq!(other, Woken::Readable, "{mode}: wait() has no deadline");
                        if let Some(b) = waiter.try_claim().unwrap() {
                            break b;
                        }
                        if let Woken::Claimed(b) = waiter.wait().unwrap() {
                            break b;
                        }
                    },
                };
                assert_eq!(byte, b'!');
            })
        };
        let id = rx.recv().unwrap();
        pester(id, &done);
        for _ in 0..3 {
            pthread_kill(id, Signal::SIGUSR1).unwrap();
            thread::sleep(Duration::from_millis(5));
        }
        nix::unistd::write(&w, b"!").unwrap();
        t.join().unwrap();
    }
}

#[test]
fn signals_interrupt_take_interruptible() {
    if Mode::Futex.available().is_err() {
        return;
    }
    install_handler();
    let path = std::env::temp_dir().join(format!("herdless-platform-eintr-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let word = Arc::new(herdless_platform::SharedWord::create(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let t = {
        let (word, done) = (Arc::clone(&word), Arc::clone(&done));
        thread::spawn(move || {
            tx.send(pthread_self()).unwrap();
            let err = word.take_interruptible().unwrap_err();
            done.store(true, Ordering::Release);
            assert_eq!(err.kind(), io::ErrorKind::Interrupted);
            word.take().unwrap();
        })
    };
    let id = rx.recv().unwrap();
    pester(id, &done);
    pthread_kill(id, Signal::SIGUSR1).unwrap();
    word.post().unwrap();
    t.join().unwrap();
    assert_eq!(word.value(), 0);
}
