//! The classic backend of [`crate::Client`]: takes tokens from a GNU make,
//! cargo or bmake jobserver pipe.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Mutex;

use super::Wait;
use crate::classic::pipe::{Claim, Pipe, Read};
use crate::classic::slot::{self, Held, Owner, ParentSlot, SharedSlot};
use crate::classic::{Flavor, Jobserver};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::AbortReason;
use crate::sync::lock;
use herdless_platform::wait::{FairWait, Woken};

/// What a successful acquire got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Got {
    /// A byte from the pipe, now on top of the held stack.
    Byte,
    /// The parent's slot.
    Slot,
}

/// A client of a classic jobserver.
#[derive(Debug)]
pub(crate) struct Classic {
    server: Jobserver,
    pipe: Pipe,
    /// The bytes read and not yet given back, most recent last. Each is
    /// written back as it was read.
    held: Mutex<Vec<u8>>,
    aborted: Mutex<Option<AbortReason>>,
    slot: Option<ParentSlot>,
    held_slot: Mutex<Option<Held>>,
    /// The process that opened it; a fork gives nothing back for it.
    opened_by: u32,
}

impl Classic {
    /// Opens the jobserver. With `job_of_runner_above`, finds out whether the
    /// parent process owns a slot per child or shares one slot among its
    /// children (see the module docs).
    pub(crate) fn open(server: Jobserver, job_of_runner_above: bool) -> Result<Classic> {
        let pipe = Pipe::open(&server)?;
        let slot = if job_of_runner_above {
            match slot::this_slot_owner() {
                Owner::Own => Some(ParentSlot::Own(Default::default())),
                Owner::Shared(owner) => Some(ParentSlot::Shared(
                    SharedSlot::new(owner, pipe.id()).map_err(|e| {
                        Error::io(
                            ErrorKind::Io,
                            "cannot prepare the parent's job slot for this classic jobserver",
                            e,
                        )
                    })?,
                )),
                // No recipe left to share a slot with: tokens only.
                Owner::Orphaned => None,
            }
        } else {
            None
        };
        Ok(Classic {
            server,
            pipe,
            held: Mutex::new(Vec::new()),
            aborted: Mutex::new(None),
            slot,
            held_slot: Mutex::new(None),
            opened_by: std::process::id(),
        })
    }

    pub(crate) fn jobserver(&self) -> &Jobserver {
        &self.server
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.pipe.fd()
    }

    /// The jobs this client holds, for `Debug`.
    pub(crate) fn holding(&self) -> usize {
        lock(&self.held).len() + usize::from(lock(&self.held_slot).is_some())
    }

    fn io_error(&self, what: &str, e: io::Error) -> Error {
        let kind = if e.kind() == io::ErrorKind::UnexpectedEof {
            ErrorKind::BrokerGone
        } else {
            ErrorKind::Io
        };
        Error::io(
            kind,
            format!("{what} the jobserver {}", self.pipe.what()),
            e,
        )
    }

    fn aborted_error(reason: AbortReason) -> Error {
        Error::new(
            ErrorKind::Aborted(reason),
            format!(
                "the build was aborted ({reason}): bmake put its abort token in the jobserver pipe"
            ),
        )
    }

    fn check(&self) -> Result<()> {
        match *lock(&self.aborted) {
            Some(reason) => Err(Self::aborted_error(reason)),
            None => Ok(()),
        }
    }

    /// Drains the pipe and leaves one abort token in it, as bmake does, so
    /// that every other reader stops too.
    fn put_stopper(&self, reason: AbortReason) -> Result<()> {
        self.pipe
            .drain()
            .and_then(|_| self.pipe.write_byte(reason.byte()))
            .map_err(|e| self.io_error("cannot put the abort token into", e))
    }

    /// One non-blocking read of the pipe. `Ok(true)`: a token was claimed.
    fn claim(&self) -> Result<bool> {
        let byte = match self.pipe.read_byte() {
            Ok(Read::Byte(b)) => b,
            Ok(Read::Empty) => return Ok(false),
            Err(e) => return Err(self.io_error("cannot read", e)),
        };
        if self.server.flavor() == Flavor::Bmake {
            if let Some(reason) = AbortReason::from_byte(byte) {
                lock(&self.aborted).get_or_insert(reason);
                self.put_stopper(reason)?;
                return Err(Self::aborted_error(reason));
            }
        }
        lock(&self.held).push(byte);
        Ok(true)
    }

    fn try_slot(&self) -> Result<bool> {
        let Some(slot) = &self.slot else {
            return Ok(false);
        };
        let mut held = lock(&self.held_slot);
        if held.is_some() {
            return Ok(false);
        }
        match slot.try_take() {
            Ok(Some(h)) => {
                *held = Some(h);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(Error::io(
                ErrorKind::Io,
                "cannot take the parent's job slot",
                e,
            )),
        }
    }

    fn needs_blocking_read(&self, what: &str) -> Result<()> {
        if self.pipe.claim_mode() == Claim::SharedBlocking {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{what} is not possible on this jobserver: its {} is blocking, shared with \
                     the other processes, and this OS cannot open a description of its own; \
                     only a blocking acquire() can take a token",
                    self.pipe.what()
                ),
            ));
        }
        Ok(())
    }

    /// The parent's slot if free, then a token if one is in the pipe.
    pub(crate) fn try_acquire(&self) -> Result<Option<Got>> {
        self.check()?;
        if self.try_slot()? {
            return Ok(Some(Got::Slot));
        }
        self.needs_blocking_read("a non-blocking acquire")?;
        Ok(self.claim()?.then_some(Got::Byte))
    }

    /// Waits for the parent's slot or a pipe token, as `wait` allows.
    /// `Ok(None)` when the deadline passed.
    pub(crate) fn acquire(&self, wait: Wait) -> Result<Option<Got>> {
        self.check()?;
        if self.try_slot()? {
            return Ok(Some(Got::Slot));
        }
        if self.pipe.claim_mode() == Claim::SharedBlocking {
            if wait.deadline.is_some() || wait.interruptible {
                self.needs_blocking_read("a wait with a deadline or for signals")?;
            }
            return self.acquire_blocking_read();
        }
        if self.claim()? {
            return Ok(Some(Got::Byte));
        }
        let shared = match &self.slot {
            Some(ParentSlot::Shared(s)) => Some(s),
            _ => None,
        };
        let slot_wait = shared
            .map(|s| s.start_waiting())
            .transpose()
            .map_err(|e| Error::io(ErrorKind::Io, "cannot wait for the parent's job slot", e))?;
        let waiter = FairWait::new(self.pipe.fd(), slot_wait.as_ref().map(|w| w.fd()))
            .map_err(|e| self.io_error("cannot wait on", e))?;
        let from_slot = || -> Result<bool> {
            let Some(w) = &slot_wait else {
                return Ok(false);
            };
            match w.take() {
                Ok(Some(l)) => {
                    *lock(&self.held_slot) = Some(Held::Locked(l));
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(e) => Err(Error::io(
                    ErrorKind::Io,
                    "cannot take the parent's job slot",
                    e,
                )),
            }
        };
        loop {
            let woke = waiter
                .wait(wait.deadline)
                .map_err(|e| self.io_error("cannot wait on", e))?;
            // Claim after every return, whatever ended the wait: a wake-up
            // the kernel aimed at this process is used, or the byte is gone.
            if from_slot()? {
                // The slot won; a token that woke this process too must not
                // be left unannounced in the pipe (an exclusive wake-up went
                // to this process only): take it and write it straight back,
                // which wakes the next waiter.
                if self.claim()? {
                    self.release_byte()?;
                }
                return Ok(Some(Got::Slot));
            }
            if self.claim()? {
                self.pass_on_wakeup()?;
                return Ok(Some(Got::Byte));
            }
            match woke {
                Woken::Readable | Woken::Claimed(_) => {}
                Woken::TimedOut => return Ok(None),
                Woken::Interrupted if wait.interruptible => {
                    return Err(Error::new(
                        ErrorKind::Interrupted,
                        "interrupted by a signal",
                    ))
                }
                Woken::Interrupted => {}
            }
        }
    }

    /// One write wakes one exclusive waiter however many bytes it carries
    /// (a make or the bridge may write several tokens at once): a waiter
    /// that was woken, claimed a byte and still sees bytes in the pipe
    /// takes one more and writes it straight back, which wakes the next
    /// waiter. Without this, the other waiters sleep on while tokens sit
    /// unread in the pipe.
    fn pass_on_wakeup(&self) -> Result<()> {
        if herdless_platform::bytes_readable(self.pipe.fd()).unwrap_or(1) == 0 {
            return Ok(());
        }
        match self.claim() {
            Ok(true) => self.release_byte(),
            // An abort token is recorded by the claim and reported by the
            // next call; the caller already holds its token.
            Ok(false) | Err(_) => Ok(()),
        }
    }

    /// `SharedBlocking` only: the wait and the claim are one blocking
    /// `read()` of the shared description.
    fn acquire_blocking_read(&self) -> Result<Option<Got>> {
        loop {
            if self.claim()? {
                return Ok(Some(Got::Byte));
            }
        }
    }

    /// Gives back the most recently read byte, exactly as it was read. After
    /// a bmake abort, gives back the abort token instead, as bmake does.
    pub(crate) fn release_byte(&self) -> Result<()> {
        let mut held = lock(&self.held);
        let Some(byte) = held.pop() else {
            return Err(Error::new(
                ErrorKind::NotHolding,
                format!(
                    "this client holds no token from the jobserver {}",
                    self.pipe.what()
                ),
            ));
        };
        drop(held);
        if self.server.flavor() == Flavor::Bmake {
            if let Some(reason) = *lock(&self.aborted) {
                return self.put_stopper(reason);
            }
        }
        self.pipe.write_byte(byte).map_err(|e| {
            lock(&self.held).push(byte);
            self.io_error("cannot give a token back to", e)
        })
    }

    /// Gives back the parent's slot.
    pub(crate) fn release_slot(&self) -> Result<()> {
        let held = lock(&self.held_slot).take();
        match (held, &self.slot) {
            (Some(h), Some(slot)) => {
                slot.give_back(h);
                Ok(())
            }
            _ => Err(Error::new(
                ErrorKind::NotHolding,
                "this client does not hold its parent's job slot",
            )),
        }
    }

    /// Gives back one held token of any kind: a pipe byte first.
    pub(crate) fn release_any(&self) -> Result<()> {
        if !lock(&self.held).is_empty() {
            return self.release_byte();
        }
        if lock(&self.held_slot).is_some() {
            return self.release_slot();
        }
        Err(Error::new(
            ErrorKind::NotHolding,
            format!(
                "this client holds no token from the jobserver {}",
                self.pipe.what()
            ),
        ))
    }

    /// bmake: drains the pipe and puts the abort token in. GNU make has no
    /// abort token: `Unsupported`, and nothing changes.
    pub(crate) fn abort(&self, reason: AbortReason) -> Result<()> {
        match self.server.flavor() {
            Flavor::Bmake => {
                lock(&self.aborted).get_or_insert(reason);
                self.put_stopper(reason)
            }
            Flavor::Gnu => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "cannot abort the build through the {}: GNU make's jobserver has no abort \
                     token (exit with a failure status and make stops the build)",
                    self.server
                ),
            )),
        }
    }

    /// The abort this client has seen in the pipe or posted, if any.
    pub(crate) fn aborted(&self) -> Option<AbortReason> {
        *lock(&self.aborted)
    }
}

impl Drop for Classic {
    /// Gives back every token still held — those kept with
    /// [`Token::forget`](crate::client::Token::forget) included — as a
    /// closed connection does for a native client: a classic jobserver has
    /// no other way to get them back.
    fn drop(&mut self) {
        if std::process::id() != self.opened_by {
            return;
        }
        while !lock(&self.held).is_empty() {
            if self.release_byte().is_err() {
                break;
            }
        }
        if lock(&self.held_slot).is_some() {
            let _ = self.release_slot();
        }
    }
}
