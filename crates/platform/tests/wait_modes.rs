//! Each wait mode the OS offers returns when another thread writes a byte
//! to the pipe, and the byte reaches exactly this waiter.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::thread;
use std::time::Duration;

use herdless_platform::wait::{Mode, PipeWaiter, Trigger, Woken};
use nix::fcntl::OFlag;

fn pipe_modes() -> Vec<Mode> {
    Mode::ALL
        .into_iter()
        .filter(|m| *m != Mode::Futex && m.available().is_ok())
        .collect()
}

/// Waits the way a token client does: claim, else wait, until a byte comes.
fn acquire(waiter: &mut PipeWaiter) -> io::Result<u8> {
    loop {
        match waiter.try_claim() {
            Ok(Some(byte)) => return Ok(byte),
            Ok(None) => {}
            // Where the claim cannot be made without blocking, the
            // blocking-read mode still works through wait().
            Err(e) if e.kind() == io::ErrorKind::Unsupported && !waiter.mode().is_readiness() => {}
            Err(e) => return Err(e),
        }
        if let Woken::Claimed(byte) = waiter.wait()? {
            return Ok(byte);
        }
    }
}

/// A pipe whose read end's description is non-blocking (macOS has no
/// pipe2()).
fn nonblocking_pipe() -> (OwnedFd, OwnedFd) {
    use nix::fcntl::{fcntl, FcntlArg};
    let (r, w) = nix::unistd::pipe().unwrap();
    fcntl(&r, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
    (r, w)
}

/// A pipe for `mode`. On Linux always a blocking one, the harder case: the
/// waiter must claim without blocking all the same. Elsewhere the
/// readiness modes get a non-blocking description, the only one they can
/// claim from there.
fn pipe_for(mode: Mode) -> (OwnedFd, OwnedFd) {
    if cfg!(target_os = "linux") || !mode.is_readiness() {
        nix::unistd::pipe().unwrap()
    } else {
        nonblocking_pipe()
    }
}

fn write_later(w: OwnedFd, byte: u8) -> thread::JoinHandle<OwnedFd> {
    thread::spawn(move || {
        // Give the waiter time to block; the test passes either way.
        thread::sleep(Duration::from_millis(20));
        assert_eq!(nix::unistd::write(&w, &[byte]).unwrap(), 1);
        w
    })
}

#[test]
fn portable_modes_are_always_available() {
    for mode in [Mode::Poll, Mode::Select, Mode::BlockingRead] {
        assert_eq!(mode.available(), Ok(()), "{mode}");
    }
}

#[test]
fn every_available_mode_gets_the_byte() {
    for trigger in [Trigger::Level, Trigger::Edge] {
        for mode in pipe_modes() {
            let (r, w) = pipe_for(mode);
            let mut waiter = PipeWaiter::with_trigger(r.as_fd(), mode, trigger).unwrap();
            assert_eq!(waiter.mode(), mode);
            let writer = write_later(w, b'+');
            assert_eq!(acquire(&mut waiter).unwrap(), b'+', "{mode} {trigger:?}");
            let _w = writer.join().unwrap();
            // The pipe is empty again and the claim does not block.
            #[cfg(target_os = "linux")]
            assert_eq!(waiter.try_claim().unwrap(), None, "{mode}");
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn try_claim_takes_a_waiting_byte_without_blocking() {
    for mode in pipe_modes() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let waiter = PipeWaiter::new(r.as_fd(), mode).unwrap();
        assert!(waiter.has_private_claim());
        assert_eq!(waiter.try_claim().unwrap(), None);
        nix::unistd::write(&w, b"ab").unwrap();
        assert_eq!(waiter.try_claim().unwrap(), Some(b'a'));
        assert_eq!(waiter.try_claim().unwrap(), Some(b'b'));
        assert_eq!(waiter.try_claim().unwrap(), None);
    }
}

#[cfg(target_os = "linux")]
#[test]
fn the_shared_description_stays_blocking() {
    let (r, _w) = nix::unistd::pipe().unwrap();
    for mode in pipe_modes() {
        let waiter = PipeWaiter::new(r.as_fd(), mode).unwrap();
        assert_eq!(waiter.try_claim().unwrap(), None);
        let flags = nix::fcntl::fcntl(&r, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert!(
            !OFlag::from_bits_retain(flags).contains(OFlag::O_NONBLOCK),
            "{mode}"
        );
    }
}

#[cfg(target_os = "linux")]
#[test]
fn blocking_read_works_on_a_non_blocking_description() {
    let (r, w) = nonblocking_pipe();
    let mut waiter = PipeWaiter::new(r.as_fd(), Mode::BlockingRead).unwrap();
    let writer = write_later(w, b'x');
    assert_eq!(waiter.wait().unwrap(), Woken::Claimed(b'x'));
    writer.join().unwrap();
}

#[test]
fn a_closed_pipe_reports_end_of_file() {
    for mode in pipe_modes() {
        let (r, w) = pipe_for(mode);
        let mut waiter = PipeWaiter::new(r.as_fd(), mode).unwrap();
        drop(w);
        match waiter.wait() {
            Ok(Woken::Readable) => {
                let err = waiter.try_claim().unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{mode}");
            }
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{mode}"),
            Ok(other) => panic!("{mode}: {other:?} from a closed pipe"),
        }
    }
}

#[test]
fn non_pipes_and_write_ends_are_refused() {
    let (r, w) = nix::unistd::pipe().unwrap();
    let err = PipeWaiter::new(w.as_fd(), Mode::Poll).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let err = PipeWaiter::new(a.as_fd(), Mode::Poll).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let err = PipeWaiter::new(r.as_fd(), Mode::Futex).unwrap_err();
    assert!(matches!(
        err.kind(),
        io::ErrorKind::InvalidInput | io::ErrorKind::Unsupported
    ));
}
