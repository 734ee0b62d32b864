//! A pool whose shared tokens are backed by an outer pool: what `herdless
//! run` does when it is itself a job of a GNU make or a bmake (the outer
//! pool is their classic jobserver), and, for a classic command, when it
//! joins another herdless broker ([`Broker`]: the outer pool is that
//! broker's, reached as a native client).
//!
//! # The model
//!
//! `herdless run -j N` started by a make recipe is one job of that make:
//! it runs on the token the make took for the recipe, and that token is
//! its command's implicit one (the broker's top slot), as without an outer
//! make. Its N − 1 shared tokens are not its own: each one it hands out
//! must first be *borrowed* from the outer jobserver, one byte read from
//! the outer pipe or fifo, and goes back there, the very byte it read, as
//! soon as no waiter of the inner pool may take it. So:
//!
//! - the outer `-j` bounds every job of the whole build, the inner ones
//!   included, since each job beyond the recipe's own runs on an outer
//!   byte;
//! - the inner `-j` bounds the inner subtree: at most N − 1 bytes are
//!   borrowed at once;
//! - no job of a job deadlocks: the inner command's implicit token needs
//!   nothing from the outer pool, so at outer `-j1` the inner tree runs
//!   one job at a time in its top slot.
//!
//! # In the pool
//!
//! The [`Pool`] knows nothing of the outer jobserver: its capacity simply
//! grows by one for each byte borrowed ([`Pool::resize`]) and shrinks by
//! the tokens nobody here may take ([`Pool::give_up_free`]). The [`Ledger`]
//! decides, after every event of the broker, in this order:
//!
//! 1. free shared tokens are given up (a waiter that may take one would
//!    already have been granted it: the pool never leaves a token idle
//!    while one waits), and for every token the pool no longer counts
//!    (capacity plus tokens a shrink still waits for) a byte goes back to
//!    the outer jobserver at once;
//! 2. while a waiter that may take a shared token waits
//!    ([`Pool::short_of_shared`]) and fewer than N − 1 bytes are borrowed,
//!    one byte is read from the outer jobserver, without blocking; the
//!    pool grows by one and grants it to the first waiter in FIFO order.
//!    An empty outer pipe ends the step: the broker watches the outer read
//!    description and runs the step again when a byte is written.
//!
//! Conservation across both pools: the bytes borrowed are always the
//! pool's capacity plus its retiring tokens, so every outer byte is
//! either unread in the outer pipe, or counted by exactly one token of the
//! inner pool. When the broker ends, every byte still borrowed goes back,
//! exactly once, whatever the inner clients did (a classic client of the
//! inner pool that died holding a token loses it to the inner pool only).
//!
//! # bmake's abort tokens
//!
//! A byte other than `+` read from an outer bmake's pipe is its abort
//! token (`E`, `I`): the ledger writes it back, as bmake itself does, so
//! that every other make sees it, and aborts the inner pool.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::classic::pipe::{Claim, Pipe, Read};
use crate::classic::{Flavor, Jobserver};
use crate::client::{Client, Token};
use crate::error::{Error, ErrorKind};
use crate::log;
use crate::log::Level;
use crate::pool::Pool;
use crate::protocol::AbortReason;

/// What one non-blocking read of the outer jobserver found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// A byte: a token (or, from a bmake, perhaps an abort token).
    Byte(u8),
    /// Nothing to read now.
    Empty,
    /// The outer jobserver is gone (no writer left) or unreadable.
    Closed,
    /// The outer pool aborted (a herdless broker's abort).
    Aborted(AbortReason),
}

/// The outer jobserver, as the ledger uses it.
pub trait Outer {
    /// Reads one byte without blocking.
    fn take(&mut self) -> Taken;
    /// Writes one byte back.
    fn put(&mut self, byte: u8) -> io::Result<()>;
    /// Called at the end of every step: `wanted` says whether the ledger
    /// still wants a token it could not get. An outer pool that answers
    /// requests later (a herdless broker) withdraws a pending one here
    /// when it is no longer wanted.
    fn settle(&mut self, wanted: bool) {
        let _ = wanted;
    }
}

/// An outer pool the broker can watch: its [`Outer`] side, and the
/// descriptor that becomes readable when a token may be there.
pub trait Source: Outer + Send + std::fmt::Debug {
    /// The descriptor to watch for readability.
    fn fd(&self) -> RawFd;
    /// The outer pool, for messages.
    fn what(&self) -> String;
}

impl Source for Pipe {
    fn fd(&self) -> RawFd {
        Pipe::fd(self).as_raw_fd()
    }
    fn what(&self) -> String {
        Pipe::what(self).to_string()
    }
}

/// An outer herdless broker, reached as a native client: the pool of a
/// `herdless run` nested in another one borrows from it for the classic
/// clients of its subtree (see `docs/ARCHITECTURE.md`, "Nested runs").
/// Each token borrowed is a shared token of the outer pool, asked for
/// without blocking ([`Client::request_grant`]); one request at most is
/// pending, and it is withdrawn when no longer wanted.
#[derive(Debug)]
pub struct Broker {
    client: Client,
    held: Vec<Token>,
    what: String,
}

impl Broker {
    /// Borrows through `client`, a connection to the outer broker at
    /// `socket` (made with the implicit token off: every token it hands
    /// out must come from the outer pool).
    pub fn new(client: Client, socket: &std::path::Path) -> Broker {
        Broker {
            client,
            held: Vec::new(),
            what: format!("herdless broker {}", socket.display()),
        }
    }
}

impl Outer for Broker {
    fn take(&mut self) -> Taken {
        match self.client.request_grant() {
            Ok(Some(token)) => {
                self.held.push(token);
                Taken::Byte(b'+')
            }
            Ok(None) => Taken::Empty,
            Err(e) => match e.kind() {
                ErrorKind::Aborted(reason) => Taken::Aborted(reason),
                _ => {
                    log!(
                        Level::Warn,
                        "cannot take a token from the {}: {e}",
                        self.what
                    );
                    Taken::Closed
                }
            },
        }
    }

    fn put(&mut self, _byte: u8) -> io::Result<()> {
        match self.held.pop() {
            Some(token) => token.release().map_err(io::Error::other),
            None => Err(io::Error::other("no token of the outer broker is held")),
        }
    }

    fn settle(&mut self, wanted: bool) {
        if !wanted && self.client.has_pending().unwrap_or(false) {
            // A grant that arrived meanwhile goes back with it.
            if let Err(e) = self.client.cancel_pending_nowait() {
                log!(
                    Level::Warn,
                    "cannot withdraw a request from the {}: {e}",
                    self.what
                );
            }
        }
    }
}

impl Source for Broker {
    fn fd(&self) -> RawFd {
        self.client.as_raw_fd()
    }
    fn what(&self) -> String {
        self.what.clone()
    }
}

impl Outer for Pipe {
    fn take(&mut self) -> Taken {
        match self.read_byte() {
            Ok(Read::Byte(b)) => Taken::Byte(b),
            Ok(Read::Empty) => Taken::Empty,
            Err(e) => {
                log!(Level::Warn, "cannot read the outer jobserver: {e}");
                Taken::Closed
            }
        }
    }

    fn put(&mut self, byte: u8) -> io::Result<()> {
        self.write_byte(byte)
    }
}

/// Counts kept by the ledger, readable from another thread.
#[derive(Debug, Default)]
pub struct Figures {
    /// Bytes read from the outer jobserver.
    pub borrowed: AtomicU64,
    /// Bytes written back to it.
    pub returned: AtomicU64,
    /// The most bytes borrowed at once.
    pub max_held: AtomicU64,
    /// Bytes that could not be written back.
    pub lost: AtomicU64,
}

/// The pure bookkeeping of a backed pool (see the module documentation):
/// which bytes are borrowed, and the rules of when to borrow and give
/// back. The outer jobserver is passed in, so the rules are tested on an
/// in-memory one.
#[derive(Debug)]
pub struct Ledger {
    flavor: Flavor,
    /// The most bytes borrowed at once: N − 1 for `-jN`.
    limit: u32,
    /// The bytes borrowed, in the order read.
    held: Vec<u8>,
    closed: bool,
    aborted: Option<AbortReason>,
    figures: Arc<Figures>,
}

impl Ledger {
    /// A ledger for `-j jobs` under an outer jobserver of `flavor`.
    pub fn new(flavor: Flavor, jobs: u32) -> Ledger {
        Ledger {
            flavor,
            limit: jobs.saturating_sub(1),
            held: Vec::new(),
            closed: false,
            aborted: None,
            figures: Arc::default(),
        }
    }

    /// Bytes borrowed now.
    pub fn held(&self) -> u32 {
        self.held.len() as u32
    }

    /// The most bytes that may be borrowed at once.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// A new `-j`: at most `jobs - 1` bytes borrowed from now on. The pool
    /// is left as it is: while it runs, [`Ledger::resize`] also bounds it.
    pub fn set_jobs(&mut self, jobs: u32) {
        self.limit = jobs.saturating_sub(1);
    }

    /// A new `-j` while the pool runs: sets the limit ([`Ledger::set_jobs`])
    /// and bounds the pool by it ([`Pool::bound_backed`]). A pool above
    /// the new limit shrinks, and its bytes go back as it lets go of its
    /// tokens; a grow first keeps what an earlier shrink still waits for,
    /// as many as the new limit allows, so that the next step borrows at
    /// once for the waiters the new limit lets run. No byte is borrowed or
    /// given back here: the bytes held stay the pool's capacity plus its
    /// retiring tokens.
    pub fn resize(&mut self, pool: &mut Pool, jobs: u32, now: Duration) {
        self.set_jobs(jobs);
        pool.bound_backed(self.limit, now);
    }

    /// The abort token read from an outer bmake, if one was.
    pub fn aborted(&self) -> Option<AbortReason> {
        self.aborted
    }

    /// The counts, shared.
    pub fn figures(&self) -> Arc<Figures> {
        self.figures.clone()
    }

    /// One step after an event: gives back what the pool no longer needs,
    /// then borrows for the waiters it cannot serve. `grow` adds one token
    /// to the pool (the broker also counts it for its statistics).
    pub fn balance(&mut self, pool: &mut Pool, outer: &mut (impl Outer + ?Sized), now: Duration) {
        pool.give_up_free();
        self.give_back_surplus(pool, outer);
        while !self.closed
            && self.aborted.is_none()
            && pool.short_of_shared()
            && pool.capacity() < self.limit
        {
            match outer.take() {
                Taken::Byte(b) if self.flavor == Flavor::Bmake && b != b'+' => {
                    let reason = AbortReason::from_byte(b).unwrap_or(AbortReason::Error);
                    log!(
                        Level::Info,
                        "the outer bmake posted an abort token ({reason}); aborting"
                    );
                    if let Err(e) = outer.put(b) {
                        log!(
                            Level::Warn,
                            "cannot put the abort token back into the outer pipe: {e}"
                        );
                    }
                    self.aborted = Some(reason);
                    pool.abort(reason);
                }
                Taken::Byte(b) => {
                    self.held.push(b);
                    self.figures.borrowed.fetch_add(1, Ordering::Relaxed);
                    self.figures
                        .max_held
                        .fetch_max(self.held.len() as u64, Ordering::Relaxed);
                    pool.resize(pool.capacity() + 1, now);
                }
                Taken::Aborted(reason) => {
                    log!(Level::Info, "the outer pool aborted ({reason}); aborting");
                    self.aborted = Some(reason);
                    pool.abort(reason);
                }
                Taken::Empty => break,
                Taken::Closed => {
                    log!(
                        Level::Warn,
                        "the outer jobserver is gone; no more tokens are borrowed"
                    );
                    self.closed = true;
                }
            }
        }
        let wanted = !self.closed
            && self.aborted.is_none()
            && pool.short_of_shared()
            && pool.capacity() < self.limit;
        outer.settle(wanted);
    }

    /// Writes back every byte the pool no longer counts.
    fn give_back_surplus(&mut self, pool: &Pool, outer: &mut (impl Outer + ?Sized)) {
        let needed = pool.capacity() + pool.retiring();
        while self.held() > needed {
            let b = self.held.pop().expect("more held than needed");
            self.put_back(outer, b);
        }
    }

    fn put_back(&mut self, outer: &mut (impl Outer + ?Sized), byte: u8) {
        match outer.put(byte) {
            Ok(()) => self.figures.returned.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                log!(
                    Level::Warn,
                    "cannot give a token back to the outer jobserver: {e}"
                );
                self.figures.lost.fetch_add(1, Ordering::Relaxed)
            }
        };
    }

    /// At the end: every byte still borrowed goes back, exactly once.
    /// Returns how many went back now.
    pub fn give_back_all(&mut self, outer: &mut (impl Outer + ?Sized)) -> u32 {
        let n = self.held();
        while let Some(b) = self.held.pop() {
            self.put_back(outer, b);
        }
        outer.settle(false);
        n
    }
}

/// A [`Ledger`] on its outer pool: a classic jobserver's pipe or fifo, or
/// a herdless broker.
#[derive(Debug)]
pub struct Backing {
    ledger: Ledger,
    outer: Box<dyn Source>,
}

impl Backing {
    /// Opens the outer jobserver `js` (through a read description of its
    /// own: see `classic/pipe.rs`) for a pool of `-j jobs`.
    ///
    /// # Errors
    ///
    /// Those of the classic client: the jobserver is disabled, or its
    /// descriptors are not open, not a pipe, or not one pipe's two ends
    /// (GNU make closes them for recipes not marked `+`), or its fifo is
    /// gone; `Unsupported` for a blocking pipe this OS cannot reopen (the
    /// BSDs and macOS under GNU make before 4.3).
    pub fn open(js: &Jobserver, jobs: u32) -> crate::error::Result<Backing> {
        let pipe = Pipe::open(js)?;
        if pipe.claim_mode() == Claim::SharedBlocking {
            // The broker's loop must never block on a read.
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the outer jobserver's {} is blocking, and this OS cannot open a \
                     description of it of its own",
                    pipe.what()
                ),
            ));
        }
        Ok(Backing {
            ledger: Ledger::new(js.flavor(), jobs),
            outer: Box::new(pipe),
        })
    }

    /// Borrows from an outer herdless broker through `outer`, for a pool
    /// of `-j jobs`.
    pub fn broker(outer: Broker, jobs: u32) -> Backing {
        Backing {
            ledger: Ledger::new(Flavor::Gnu, jobs),
            outer: Box::new(outer),
        }
    }

    /// The descriptor to watch for readability: a byte was written to the
    /// outer jobserver.
    pub fn fd(&self) -> RawFd {
        self.outer.fd()
    }

    /// The outer pool, for messages.
    pub fn what(&self) -> String {
        self.outer.what()
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// See [`Ledger::set_jobs`].
    pub fn set_jobs(&mut self, jobs: u32) {
        self.ledger.set_jobs(jobs);
    }

    /// See [`Ledger::resize`].
    pub fn resize(&mut self, pool: &mut Pool, jobs: u32, now: Duration) {
        self.ledger.resize(pool, jobs, now);
    }

    /// See [`Ledger::balance`].
    pub fn balance(&mut self, pool: &mut Pool, now: Duration) {
        self.ledger.balance(pool, &mut *self.outer, now);
    }

    /// See [`Ledger::give_back_all`].
    pub fn give_back_all(&mut self) -> u32 {
        self.ledger.give_back_all(&mut *self.outer)
    }
}

/// The last resort of "every byte back, exactly once": a broker that ends
/// without [`Backing::give_back_all`] (its loop returned an error, or its
/// thread panicked and unwinds) drops its backing, and every byte still
/// borrowed goes back then. After `give_back_all` none is held, so none
/// goes back twice.
impl Drop for Backing {
    fn drop(&mut self) {
        let held = self.ledger.held();
        if held != 0 {
            log!(
                Level::Warn,
                "the pool ended without giving its {held} borrowed token(s) back; giving them \
                 back to the {} now",
                self.outer.what()
            );
            self.give_back_all();
        }
    }
}

#[cfg(test)]
mod tests;
