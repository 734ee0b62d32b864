//! The shared token table: the fast path for native clients on the broker's
//! host (ARCHITECTURE §3, "The fast path").
//!
//! The broker lends free tokens of its pool to a table in shared memory
//! (a sealed memfd, [`herdless_platform::Segment`]) that every client which
//! asked for it maps. A client takes a token from the table and gives it
//! back with one atomic instruction each, without a system call; the
//! broker stays the owner of the pool, the reclaimer of what dead clients
//! held, and the keeper of every rule.
//!
//! # The words
//!
//! Each table word is one token lent to the table, or a place for one:
//!
//! | value | meaning |
//! |---|---|
//! | [`OUT`] | not lent: the token (if any) is in the broker's pool |
//! | [`FREE`] (0) | lent and free: any client may take it |
//! | an owner id | lent and held by the client of that id |
//!
//! Ownership changes by one compare-and-swap on one word: take is
//! `FREE → me`, give back is `me → FREE`, the broker's lending is
//! `OUT → FREE` (a store: only the broker writes `OUT` words) and its
//! taking back is `FREE → OUT`; reclaiming a dead client's token is
//! `owner → FREE`. A process killed between any two instructions has
//! either done its swap or not: no token is lost or counted twice.
//!
//! # The gate and the lost wake-up
//!
//! The table is *open* ([`GATE`] = 0) only while nothing but FIFO order
//! would decide who gets a token (no waiter at the broker, no cap, no
//! admission limit, no slot free for a client of the table, no abort, no
//! stop, no shrink). The broker closes it (`GATE` = 1) as soon as any of
//! that changes, then takes every free word back into the pool. A client
//! takes from the table only while it is open, and a client that gives a
//! token back while it is closed tells the broker ([`Request::Returned`]).
//! The race between a give-back that finds the gate open and a broker that
//! closes it is Dekker's: the client swaps its word (`me → FREE`) and then
//! reads the gate, the broker writes the gate and then reads the words,
//! all sequentially consistent. In the single order of those four steps
//! either the client's read comes after the broker's write (it sees the
//! gate closed and tells the broker) or the broker's read of the word comes
//! after the client's swap (it finds the word free and takes it back); no
//! order lets both miss, so no token stays free in a closed table.
//!
//! [`Request::Returned`]: crate::protocol::Request::Returned

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use herdless_platform::Segment;

/// A word not lent to the table.
pub const OUT: u32 = u32::MAX;
/// A lent word that nobody holds.
pub const FREE: u32 = 0;

/// Header word: [`MAGIC`].
const H_MAGIC: u32 = 0;
/// Header word: the layout version, [`LAYOUT`].
const H_LAYOUT: u32 = 1;
/// Header word: the number of table words.
const H_WORDS: u32 = 2;
/// Header word: 0 while the table is open, 1 while it is closed.
pub const GATE: u32 = 3;
/// Header word: tokens held from the table or the broker's pool now, as
/// far as the clients and the broker have counted them.
const H_IN_USE: u32 = 5;
/// Header word: the most of [`H_IN_USE`] seen.
const H_PEAK: u32 = 6;

/// "HRDT" as a little-endian word.
const MAGIC: u32 = u32::from_le_bytes(*b"HRDT");
/// The layout of this module.
const LAYOUT: u32 = 1;

/// The shared token table, as both the broker and a client see it.
#[derive(Debug)]
pub struct Table {
    seg: Segment,
}

impl Table {
    /// Makes a table of `words` words, all [`OUT`], closed (broker side).
    ///
    /// # Errors
    ///
    /// Those of [`Segment::create`].
    pub fn create(words: u32) -> io::Result<Table> {
        let seg = Segment::create(words)?;
        let t = Table { seg };
        for i in 0..words {
            t.word(i).store(OUT, SeqCst);
        }
        t.seg.header(H_LAYOUT).store(LAYOUT, SeqCst);
        t.seg.header(H_WORDS).store(words, SeqCst);
        t.seg.header(GATE).store(1, SeqCst);
        t.seg.header(H_MAGIC).store(MAGIC, SeqCst);
        Ok(t)
    }

    /// Maps a table received from the broker (client side).
    ///
    /// # Errors
    ///
    /// Those of [`Segment::open`], or `InvalidData` when the header is not
    /// a table's of this layout and size.
    pub fn open(fd: OwnedFd, words: u32) -> io::Result<Table> {
        let seg = Segment::open(fd, words)?;
        if seg.header(H_MAGIC).load(SeqCst) != MAGIC
            || seg.header(H_LAYOUT).load(SeqCst) != LAYOUT
            || seg.header(H_WORDS).load(SeqCst) != words
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the shared token table has another layout",
            ));
        }
        Ok(Table { seg })
    }

    /// The number of words.
    pub fn words(&self) -> u32 {
        self.seg.words()
    }

    /// Word `i`.
    pub fn word(&self, i: u32) -> &AtomicU32 {
        self.seg.word(i)
    }

    fn header(&self, i: u32) -> &AtomicU32 {
        self.seg.header(i)
    }

    /// Grants made from the table.
    fn grants(&self) -> &AtomicU64 {
        self.seg.counter64()
    }

    /// Whether the table is open.
    pub fn is_open(&self) -> bool {
        self.header(GATE).load(SeqCst) == 0
    }

    // ---- client side -----------------------------------------------------

    /// Takes a free word for `me` if the table is open: the index taken.
    /// `start` spreads clients over the table.
    pub fn take(&self, me: u32, start: u32) -> Option<u32> {
        if me == FREE || me == OUT || !self.is_open() {
            return None;
        }
        let n = self.words();
        for k in 0..n {
            let i = (start % n + k) % n;
            let w = self.word(i);
            if w.load(SeqCst) == FREE && w.compare_exchange(FREE, me, SeqCst, SeqCst).is_ok() {
                let now = self.header(H_IN_USE).fetch_add(1, SeqCst).wrapping_add(1);
                self.header(H_PEAK).fetch_max(now, SeqCst);
                self.grants().fetch_add(1, SeqCst);
                return Some(i);
            }
        }
        None
    }

    /// Gives back one word `me` holds. `None` when it holds none (the
    /// broker took them back: the connection was cut); otherwise whether
    /// the broker must be told (the table was closed after the swap).
    pub fn give_back(&self, me: u32, hint: Option<u32>) -> Option<bool> {
        if me == FREE || me == OUT {
            return None;
        }
        let n = self.words();
        let first = hint.filter(|&i| i < n).into_iter();
        for i in first.chain(0..n) {
            let w = self.word(i);
            if w.load(SeqCst) != me {
                continue;
            }
            // Counted down before the swap, so the count never exceeds the
            // words held, whatever instruction a kill lands on.
            self.header(H_IN_USE).fetch_sub(1, SeqCst);
            if w.compare_exchange(me, FREE, SeqCst, SeqCst).is_ok() {
                return Some(!self.is_open());
            }
            self.header(H_IN_USE).fetch_add(1, SeqCst);
        }
        None
    }

    // ---- broker side -----------------------------------------------------

    /// Opens the table to takers.
    pub fn open_gate(&self) {
        self.header(GATE).store(0, SeqCst);
    }

    /// Closes the table: from now on takers fail and givers tell the
    /// broker. The caller then reads every lent word.
    pub fn close_gate(&self) {
        self.header(GATE).store(1, SeqCst);
    }

    /// Lends word `i` (which the broker knows to be [`OUT`]) as free.
    pub fn lend(&self, i: u32) {
        self.word(i).store(FREE, SeqCst);
    }

    /// Takes word `i` back if it is free. Whatever a client wrote into a
    /// word the broker lent, the token stays the broker's to count.
    pub fn take_back(&self, i: u32) -> bool {
        self.word(i)
            .compare_exchange(FREE, OUT, SeqCst, SeqCst)
            .is_ok()
    }

    /// Frees word `i` if it still reads `owner`; counted out of the tokens
    /// in use.
    pub fn reclaim(&self, i: u32, owner: u32) -> bool {
        let done = self
            .word(i)
            .compare_exchange(owner, FREE, SeqCst, SeqCst)
            .is_ok();
        if done {
            let _ = self
                .header(H_IN_USE)
                .fetch_update(SeqCst, SeqCst, |v| v.checked_sub(1));
        }
        done
    }

    /// Puts back [`OUT`] in a word the broker did not lend, if it still
    /// reads `seen`.
    pub fn restore_out(&self, i: u32, seen: u32) {
        let _ = self.word(i).compare_exchange(seen, OUT, SeqCst, SeqCst);
    }

    /// Adds the broker's own change in tokens in use (a delta, wrapping)
    /// and notes the peak.
    pub fn add_in_use(&self, delta: i64) {
        let now = if delta >= 0 {
            self.header(H_IN_USE)
                .fetch_add(delta as u32, SeqCst)
                .wrapping_add(delta as u32)
        } else {
            let d = delta.unsigned_abs() as u32;
            self.header(H_IN_USE).fetch_sub(d, SeqCst).wrapping_sub(d)
        };
        if i32::try_from(now).is_ok() {
            self.header(H_PEAK).fetch_max(now, SeqCst);
        }
    }

    /// The most tokens in use at once that the table has seen (clients
    /// write it: the broker bounds it before reporting it).
    pub fn peak(&self) -> u32 {
        self.header(H_PEAK).load(SeqCst)
    }

    /// Grants made from the table (clients count them).
    pub fn grant_count(&self) -> u64 {
        self.grants().load(SeqCst)
    }
}

impl AsFd for Table {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.seg.as_fd()
    }
}

#[cfg(test)]
mod tests;
