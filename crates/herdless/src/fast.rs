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
//! # Waiting in the table, and the direct hand-off
//!
//! Where the broker can put the table under a [`DeathGuard`] (Linux), a
//! client that finds no free word while the table is open waits in the
//! table itself: each client has a slot of four words on one cache
//! line: a state, a ticket, a wake word (how a giver wakes it) and one
//! unused. It sets its state to *waiting*, then draws a ticket from a
//! counter (slot 0's ticket word), stores it, and sleeps on its state
//! word (a futex). A client giving a token back hands it straight to the
//! waiter with the oldest ticket, in two steps, each one compare-and-swap:
//!
//! 1. the token's word goes from `me` to a *gift* `(me → heir)`: the token
//!    is the heir's from this instruction on (reclaimed with the heir if it
//!    dies);
//! 2. the heir's state goes from *waiting* to *woken*, then one
//!    `FUTEX_WAKE` of that word wakes that process alone.
//!
//! A contended giver finds the oldest waiter without looking at every
//! slot: a waiter that stored its ticket `t` also writes its slot, with
//! `t`'s low bits, in entry `t mod R` of a ring of R ≥ 2 × slots words,
//! and the ring's head word names the oldest ticket that may still wait.
//! The giver walks the ring from the head: an entry written for its
//! ticket whose slot holds that ticket and waits is the heir; one whose
//! slot holds another ticket, or does not wait, is a wait that ended, and
//! the giver moves the head past it. The ring is only a guide, checked at
//! every step against the slots themselves: an entry not written yet (its
//! waiter between its ticket and its entry), an overwritten one, a head
//! further behind than the ring is long, or a walk that finds nobody
//! (before the giver frees the word, and again after) sends the giver to
//! look at every slot. That look moves the head to the oldest ticket it
//! found if that was drawn before the giver read the ticket counter,
//! otherwise to the counter as read; not at all while a slot reads
//! waiting with a claimed ticket word (a waiter between its state and
//! its ticket, whose ticket may be older than any seen, or a claim not
//! woken yet). A hostile client that writes the ring can hide a waiter
//! from it, which then waits until a walk finds nobody else: it costs
//! order, never a token.
//!
//! When step 2 fails (the heir withdrew, or another giver woke it first)
//! the giver takes its gift back (`gift → me`) and looks again. A woken
//! client turns every gift addressed to it into its own id and keeps one
//! token (an extra one, left by a giver that died between its steps, is
//! given back at once). A giver that finds nobody waiting frees the word
//! and looks again once: the waiter sets its state *then* looks for a free
//! word, the giver frees the word *then* looks for a waiter, all
//! sequentially consistent, so one of them sees the other (Dekker again).
//!
//! The broker's death ends every wait without a timer: the state values
//! *waiting* and *woken* carry the guard thread's id with `FUTEX_WAITERS`
//! set, and the guard's robust futex list names every state word, so when
//! the broker's process dies, however, the kernel clears the id from each
//! such word and wakes its sleeper (ARCHITECTURE §3, "The fast path").
//! Slot 0's state holds the id alone while the broker lives: a client
//! checks it after it starts waiting, so it never starts a wait the kernel
//! will not end.
//!
//! When the table closes, the broker *moves* every waiter to its queue in
//! ticket order: it sets the waiter's state to *woken* without a gift and
//! queues an `Acquire` for it, whose `Grant` comes over the socket.
//!
//! [`Request::Returned`]: crate::protocol::Request::Returned
//! [`DeathGuard`]: herdless_platform::DeathGuard

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Instant;

use herdless_platform::{
    send_wake, DeathGuard, Segment, FUTEX_OWNER_DIED, FUTEX_TID_MASK, FUTEX_WAITERS,
};

/// A word not lent to the table.
pub const OUT: u32 = u32::MAX;
/// A lent word that nobody holds.
pub const FREE: u32 = 0;
/// The bit that marks a gift in a token word: `GIFT | giver << 16 | heir`.
const GIFT: u32 = 0x8000_0000;
/// The giver named in a gift the broker makes (never a client's id).
pub const BROKER_GIVER: u32 = 0x7fff;
/// The most client slots a table has (each id is 1 to this): as many as
/// the broker's death guard can watch besides slot 0 (the kernel walks at
/// most 2048 entries of a robust list). A client beyond them uses the
/// socket, and a wait of its at the broker closes the table, whose
/// waiters then pay a second wake-up each (moved to the broker's queue).
pub const MAX_SLOTS: u32 = DeathGuard::MAX_WORDS as u32 - 1;

/// Header word: [`MAGIC`].
const H_MAGIC: u32 = 0;
/// Header word: the layout version, [`LAYOUT`].
const H_LAYOUT: u32 = 1;
/// Header word: the number of token words.
const H_WORDS: u32 = 2;
/// Header word: 0 while the table is open, 1 while it is closed, 2 while
/// it is half-open ([`HALF_OPEN`]).
pub const GATE: u32 = 3;
/// [`GATE`]'s value while the table is *half-open*: nobody takes from it
/// and givers give back to the broker, as when it is closed, but clients
/// may start waits in it; the broker serves its own queue first, then
/// opens the table to them.
pub const HALF_OPEN: u32 = 2;
/// Header word: the number of client slots.
const H_SLOTS: u32 = 4;
/// Header word: tokens held from the table or the broker's pool now, as
/// far as the clients and the broker have counted them.
const H_IN_USE: u32 = 5;
/// Header word: the most of [`H_IN_USE`] seen.
const H_PEAK: u32 = 6;
/// Header word: the highest client id in use (givers look no further).
const H_HI: u32 = 7;
/// Header word: the guard thread's id; 0 when nobody may wait in the
/// table.
const H_TID: u32 = 10;
/// Header word: a countdown of the takes and waits in the table after
/// which the broker wants to hear of the next (0: never): each take and
/// each wait that starts takes 1 off, and the client that takes it to 0
/// tells the broker with [`Request::Returned`] (a classic bridge's next
/// offer is due: the broker sees no grant or wait in the table). With
/// [`NOTIFY_WAITS`] set, only waits count (a classic bridge's standing
/// offer is out: the first native that waits must have it back). With
/// [`NOTIFY_FREE`] set, also the first give-back that leaves a word free.
const H_NOTIFY: u32 = 11;
/// In [`H_NOTIFY`]: only waits that start count down, takes do not.
const NOTIFY_WAITS: u32 = 0x8000_0000;
/// In [`H_NOTIFY`]: the first give-back that leaves a word free (nobody
/// waits for it) tells the broker, and clears this bit (a classic bridge
/// has no offer out while natives wait in the table: once they stop, a
/// classic reader must have one).
const NOTIFY_FREE: u32 = 0x4000_0000;
/// In [`H_NOTIFY`]: the count of takes and waits.
const NOTIFY_COUNT: u32 = NOTIFY_FREE - 1;
/// Header word: waits in the table withdrawn (at a deadline, or by a
/// poll loop's caller).
const H_CANCELLED: u32 = 12;
/// Header word: the broker's PID namespace
/// ([`herdless_platform::pid_namespace`], 0 when unknown). A client in
/// another one uses the socket alone: the process ids in wake words, and
/// the signals it would send to them, would name other processes.
const H_PIDNS: u32 = 13;
/// Header words 14–15: waiters woken with a token handed to them (64
/// bits).
const H_HANDOFFS: u32 = 14;

/// After the slots: the sum of the waits in the table that ended in a
/// token (ns, 64 bits), then their longest (ns, 64 bits), then one count
/// per bucket of `crate::stats::Histogram`.
const X_SUM: u32 = 0;
const X_MAX: u32 = 2;
const X_COUNTS: u32 = 4;

/// "HRDT" as a little-endian word.
const MAGIC: u32 = u32::from_le_bytes(*b"HRDT");
/// The layout of this module.
const LAYOUT: u32 = 7;

/// A slot's state: not waiting.
const IDLE: u32 = 0;
/// A slot's state after the broker closed its client's connection: no
/// wait can start in it.
const SHUT: u32 = 0x3fff_fffe;
/// The bit of a ticket word that says its wait was claimed, by the id in
/// its low 16 bits (a giver, [`BROKER_GIVER`], or the waiter itself,
/// withdrawing).
const CLAIMED: u32 = 0x8000_0000;
/// The bits of a ticket.
const TICKET_MASK: u32 = 0x7fff_ffff;
/// A ticket word claimed by its own waiter: the wait is withdrawn. (A
/// giver may hand a token to a waiter of its own client: another thread.)
const WITHDRAWN: u32 = CLAIMED | 0x7ffe;
/// A ticket word claimed by the broker to move the wait to its queue (a
/// token the broker itself hands on is claimed as [`BROKER_GIVER`]).
const MOVED: u32 = CLAIMED | 0x7ffd;

/// How a claimed wait ended, as its waiter finds it.
enum Ended {
    /// The claimer's gift is now the waiter's.
    Got,
    /// The broker moved the wait to its queue.
    Moved,
    /// The broker is gone, or closed this client.
    Gone,
    /// Woken with nothing: wait again.
    Again,
}

/// How withdrawing a wait went.
enum Leave {
    /// Withdrawn before anybody claimed it.
    Withdrawn,
    /// It had ended: how.
    Ended(Ended),
    /// Claimed, and not woken yet (only when the withdrawal does not
    /// wait for that).
    InFlight,
}

/// What looking at a wait found.
enum Step {
    /// It goes on.
    Wait,
    /// It ended.
    End(WaitEnd),
    /// Woken with nothing (or a free word taken by another): wait again.
    Again,
}

impl From<Ended> for Step {
    fn from(e: Ended) -> Step {
        match e {
            Ended::Got => Step::End(WaitEnd::Got(1)),
            Ended::Moved => Step::End(WaitEnd::Moved),
            Ended::Gone => Step::End(WaitEnd::Gone),
            Ended::Again => Step::Again,
        }
    }
}

/// A wait in the table by a process that waits in its own poll loop
/// ([`Table::poll_start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWait {
    t: u32,
    tid: u32,
    pid: u32,
    since: Instant,
}

/// Where a poll-loop wait stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollStep {
    /// It goes on: poll, then look again.
    Waiting(PollWait),
    /// It ended ([`WaitEnd::Got`]: the caller holds the token).
    Ended(WaitEnd),
}

/// The gift of a token from `giver` to `heir`.
pub fn gift(giver: u32, heir: u32) -> u32 {
    GIFT | (giver & 0x7fff) << 16 | (heir & 0xffff)
}

/// The giver and heir of a gift, if `v` is one.
pub fn as_gift(v: u32) -> Option<(u32, u32)> {
    (v != OUT && v & GIFT != 0).then_some(((v >> 16) & 0x7fff, v & 0xffff))
}

/// The environment variable that, set to `0` in a broker's environment,
/// keeps waits out of the table.
pub const HANDOFF_ENV: &str = "HERDLESS_HANDOFF";

/// Whether a broker here would let clients wait in its table: a table can
/// be made and put under a guard, and [`HANDOFF_ENV`] does not forbid it.
///
/// # Errors
///
/// Why not, in words.
pub fn handoff_support() -> Result<(), String> {
    if std::env::var_os(HANDOFF_ENV).is_some_and(|v| v == "0") {
        return Err(format!("{HANDOFF_ENV}=0"));
    }
    let table = Table::create(1, 1).map_err(|e| e.to_string())?;
    table.guard().map(drop).map_err(|e| e.to_string())
}

/// How a wait in the table ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// A giver handed this client tokens: it holds this many (at least 1).
    Got(u32),
    /// The broker moved the wait to its queue: the grant comes over the
    /// socket.
    Moved,
    /// The table is closed, or nobody may wait in it: ask the broker.
    Closed,
    /// The deadline passed; the wait is withdrawn.
    TimedOut,
    /// The broker's process is gone.
    Gone,
}

/// How a hand-on ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOn {
    /// The token went to a waiter.
    Handed,
    /// Nobody waited: the word is free.
    Freed,
    /// The word was free and somebody took it meanwhile.
    Taken,
    /// The word no longer held what the giver thought (the broker took it
    /// back).
    Lost,
}

/// The words of a slot: its state, its ticket, its wake word and one
/// unused, so that a giver finds all three on one cache line.
const SLOT_WORDS: u32 = 4;

/// Where the slot area starts, in the segment's words: after the token
/// words, 16-aligned (no slot straddles a cache line).
fn slot_base(words: u32) -> u32 {
    (words + 3) & !3
}

/// Where the wait figures start: after the slots.
fn extra_base(words: u32, slots: u32) -> u32 {
    slot_base(words) + SLOT_WORDS * (slots + 1)
}

/// Where the ring of waits starts: after the wait figures, 8-aligned. Its
/// first word is the ring's head, the rest its entries.
fn ring_base(words: u32, slots: u32) -> u32 {
    (extra_base(words, slots) + X_COUNTS + crate::stats::BUCKETS as u32 + 1) & !1
}

/// The entries of the ring of waits of a table of `slots` slots: a power
/// of two, twice the slots or more, so a wait's entry outlives the waits
/// that start after it while every slot waits once.
fn ring_len(slots: u32) -> u32 {
    (2 * slots).max(64).next_power_of_two()
}

/// The segment words of a table of `words` token words and `slots` slots.
pub fn segment_words(words: u32, slots: u32) -> u32 {
    ring_base(words, slots) + 1 + ring_len(slots)
}

/// The bits of a ring entry that name its slot; the rest hold the low
/// bits of its ticket.
const RING_SLOT_BITS: u32 = 11;
const RING_SLOT_MASK: u32 = (1 << RING_SLOT_BITS) - 1;
const _: () = assert!(MAX_SLOTS <= RING_SLOT_MASK);

/// The ring entry of the wait of slot `k` with ticket `t`.
fn ring_entry(t: u32, k: u32) -> u32 {
    t << RING_SLOT_BITS | k
}

/// Whether ring entry `e` was written for ticket `t`: its slot, if so.
fn ring_slot(e: u32, t: u32) -> Option<u32> {
    let k = e & RING_SLOT_MASK;
    (k != 0 && e >> RING_SLOT_BITS == t & (u32::MAX >> RING_SLOT_BITS)).then_some(k)
}

/// How many tickets before `next` (the counter as read) ticket `t` was
/// drawn; 0 for one drawn at or after that read (tickets wrap).
fn ticket_age(t: u32, next: u32) -> u32 {
    let age = next.wrapping_sub(t) & TICKET_MASK;
    if age > TICKET_MASK / 2 {
        0
    } else {
        age
    }
}

/// When clients of the table tell the broker of what they do there
/// ([`Table::set_notify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    /// Never.
    Never,
    /// At the n-th take or wait from now (at least the first).
    After(u32),
    /// At the first wait that starts; takes are not told.
    FirstWait,
    /// At the n-th take or wait from now, or at the first give-back that
    /// leaves a word free, whichever comes first.
    AfterOrFree(u32),
}

/// The shared token table, as both the broker and a client see it.
#[derive(Debug)]
pub struct Table {
    seg: Segment,
    words: u32,
    slots: u32,
}

impl Table {
    /// Makes a table of `words` token words, all [`OUT`], and `slots`
    /// client slots, closed, with nobody allowed to wait in it (broker
    /// side; [`guard`](Self::guard) allows waiting).
    ///
    /// # Errors
    ///
    /// `InvalidInput` for more than [`MAX_SLOTS`] slots; those of
    /// [`Segment::create`].
    pub fn create(words: u32, slots: u32) -> io::Result<Table> {
        if slots > MAX_SLOTS || words == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a table has 1 or more words and at most {MAX_SLOTS} slots"),
            ));
        }
        let seg = Segment::create(segment_words(words, slots))?;
        let t = Table { seg, words, slots };
        for i in 0..words {
            t.word(i).store(OUT, SeqCst);
        }
        // Between waits a ticket word holds a claimed value.
        for k in 1..=slots {
            t.ticket(k).store(WITHDRAWN, SeqCst);
        }
        t.seg.header(H_LAYOUT).store(LAYOUT, SeqCst);
        t.seg.header(H_WORDS).store(words, SeqCst);
        t.seg.header(H_SLOTS).store(slots, SeqCst);
        t.seg.header(GATE).store(1, SeqCst);
        t.seg
            .header(H_PIDNS)
            .store(herdless_platform::pid_namespace().unwrap_or(0), SeqCst);
        t.seg.header(H_MAGIC).store(MAGIC, SeqCst);
        Ok(t)
    }

    /// Maps a table received from the broker (client side); `total` is the
    /// segment's size in words, as the broker said.
    ///
    /// # Errors
    ///
    /// Those of [`Segment::open`], or `InvalidData` when the header is not
    /// a table's of this layout and size.
    pub fn open(fd: OwnedFd, total: u32) -> io::Result<Table> {
        let seg = Segment::open(fd, total)?;
        let words = seg.header(H_WORDS).load(SeqCst);
        let slots = seg.header(H_SLOTS).load(SeqCst);
        if seg.header(H_MAGIC).load(SeqCst) != MAGIC
            || seg.header(H_LAYOUT).load(SeqCst) != LAYOUT
            || words == 0
            || slots > MAX_SLOTS
            || u64::from(segment_words(words, slots)) != u64::from(total)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the shared token table has another layout",
            ));
        }
        Ok(Table { seg, words, slots })
    }

    /// Whether this process numbers processes as the broker does (the
    /// same PID namespace): only then may it use the table.
    pub fn same_pid_namespace(&self) -> bool {
        self.header(H_PIDNS).load(SeqCst) == herdless_platform::pid_namespace().unwrap_or(0)
    }

    /// The number of token words.
    pub fn words(&self) -> u32 {
        self.words
    }

    /// The number of client slots (client ids are 1 to this).
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The segment's size in words.
    pub fn total(&self) -> u32 {
        self.seg.words()
    }

    /// Word `i` of the segment after its header (token words, slots,
    /// figures), and header word `i - total()` past those: every word any
    /// process mapping the table can write, for tests of what a hostile
    /// client can do. `None` past the header.
    pub fn raw_word(&self, i: u32) -> Option<&AtomicU32> {
        let total = self.seg.words();
        if i < total {
            Some(self.seg.word(i))
        } else if i - total < herdless_platform::HEADER_WORDS {
            Some(self.seg.header(i - total))
        } else {
            None
        }
    }

    /// Token word `i`.
    pub fn word(&self, i: u32) -> &AtomicU32 {
        assert!(i < self.words, "token word {i} out of range");
        self.seg.word(i)
    }

    fn state_index(&self, k: u32) -> u32 {
        assert!(k <= self.slots, "slot {k} out of range");
        slot_base(self.words) + SLOT_WORDS * k
    }

    /// Slot `k`'s state word (slot 0: the broker's life).
    fn state(&self, k: u32) -> &AtomicU32 {
        self.seg.word(self.state_index(k))
    }

    /// Slot `k`'s ticket word (slot 0: the next ticket).
    fn ticket(&self, k: u32) -> &AtomicU32 {
        self.seg.word(self.state_index(k) + 1)
    }

    /// Slot `k`'s wake word: 0 while its waiter sleeps on its state word,
    /// the waiter's process id while it waits in its own poll loop (woken
    /// by [`send_wake`]).
    fn wake_word(&self, k: u32) -> &AtomicU32 {
        self.seg.word(self.state_index(k) + 2)
    }

    /// Wakes the waiter of slot `k` the way its wake word says: a signal
    /// to a process that waits in its poll loop, `FUTEX_WAKE` otherwise
    /// (also when the word holds no process that can be signalled: a
    /// client can write anything there).
    fn wake_slot(&self, k: u32) {
        if !send_wake(self.wake_word(k).load(SeqCst)) {
            let _ = self.seg.wake_one(self.state_index(k));
        }
    }

    /// Wakes the waiter of slot `k` whose wait the broker moved to its
    /// queue, unless it waits in its own poll loop: that loop watches the
    /// socket, where the moved wait's grant comes (or the connection's
    /// end), so a signal now would only wake it once more before the grant
    /// (the waiter finds its wait moved when it next looks). A waiter on
    /// its state word is woken, to wait on the socket.
    fn wake_moved(&self, k: u32) {
        if !herdless_platform::valid_wake_pid(self.wake_word(k).load(SeqCst)) {
            let _ = self.seg.wake_one(self.state_index(k));
        }
    }

    fn header(&self, i: u32) -> &AtomicU32 {
        self.seg.header(i)
    }

    /// The ring's head: the oldest ticket that may still wait.
    fn ring_head(&self) -> &AtomicU32 {
        self.seg.word(ring_base(self.words, self.slots))
    }

    /// The ring entry of ticket `t`.
    fn ring_at(&self, t: u32) -> &AtomicU32 {
        let r = ring_len(self.slots);
        self.seg
            .word(ring_base(self.words, self.slots) + 1 + (t & (r - 1)))
    }

    /// Grants made from the table.
    fn grants(&self) -> &AtomicU64 {
        self.seg.counter64()
    }

    /// Header words `i` and `i + 1` as one 64-bit word.
    fn header64(&self, i: u32) -> &AtomicU64 {
        self.seg.header64(i)
    }

    /// Whether the table is open.
    pub fn is_open(&self) -> bool {
        self.header(GATE).load(SeqCst) == 0
    }

    /// Whether waits may start in the table: it is open or half-open.
    pub fn accepts_waits(&self) -> bool {
        matches!(self.header(GATE).load(SeqCst), 0 | HALF_OPEN)
    }

    /// The guard's thread id, when clients may wait in the table.
    fn tid(&self) -> Option<u32> {
        let tid = self.header(H_TID).load(SeqCst);
        (tid != 0 && tid & !FUTEX_TID_MASK == 0).then_some(tid)
    }

    /// Whether clients may wait in the table (the broker put it under a
    /// guard).
    pub fn waits_here(&self) -> bool {
        self.tid().is_some()
    }

    fn is_client(&self, k: u32) -> bool {
        (1..=self.slots).contains(&k)
    }

    fn count_taken(&self) {
        let now = self.header(H_IN_USE).fetch_add(1, SeqCst).wrapping_add(1);
        self.header(H_PEAK).fetch_max(now, SeqCst);
    }

    // ---- client side -----------------------------------------------------

    /// Takes a free word for `me` if the table is open: the index taken.
    /// `start` spreads clients over the table.
    pub fn take(&self, me: u32, start: u32) -> Option<u32> {
        if !self.is_client(me) || !self.is_open() {
            return None;
        }
        let n = self.words();
        for k in 0..n {
            let i = (start % n + k) % n;
            let w = self.word(i);
            if w.load(SeqCst) == FREE && w.compare_exchange(FREE, me, SeqCst, SeqCst).is_ok() {
                self.count_taken();
                self.grants().fetch_add(1, SeqCst);
                return Some(i);
            }
        }
        None
    }

    /// Gives back one word `me` holds: to the oldest waiter, or free.
    /// `None` when it holds none (the broker took them back: the connection
    /// was cut); otherwise whether the broker must be told (the word was
    /// freed and the table was closed after that).
    pub fn give_back(&self, me: u32, hint: Option<u32>) -> Option<bool> {
        if !self.is_client(me) {
            return None;
        }
        let n = self.words();
        let first = hint.filter(|&i| i < n).into_iter();
        for i in first.chain(0..n) {
            if self.word(i).load(SeqCst) != me {
                continue;
            }
            // Counted down before the swap, so the count never exceeds the
            // words held, whatever instruction a kill lands on.
            self.header(H_IN_USE).fetch_sub(1, SeqCst);
            match self.hand_on(i, me, me) {
                HandOn::Handed => return Some(false),
                HandOn::Freed => return Some(!self.is_open() || self.free_notice_taken()),
                HandOn::Taken => return Some(!self.is_open()),
                HandOn::Lost => {
                    self.header(H_IN_USE).fetch_add(1, SeqCst);
                }
            }
        }
        None
    }

    /// The waiting slots, each with its ticket, oldest first.
    fn waiting_slots(&self, tid: u32) -> Vec<(u32, u32)> {
        let next = self.ticket(0).load(SeqCst) & TICKET_MASK;
        let mut seen: Vec<(u32, u32, u32)> = self.claimable(tid, next).collect();
        seen.sort_by_key(|&(k, _, age)| (std::cmp::Reverse(age), k));
        seen.into_iter().map(|(k, t, _)| (k, t)).collect()
    }

    /// The waiting slot with the oldest ticket, and its ticket: from the
    /// ring when it says, otherwise by looking at every slot.
    fn heir(&self, tid: u32) -> Option<(u32, u32)> {
        let head = self.ring_head().load(SeqCst);
        let next = self.ticket(0).load(SeqCst) & TICKET_MASK;
        self.ring_heir(tid, head & TICKET_MASK, next)
            .or_else(|| self.scan_heir(tid, head, next))
    }

    /// Walks the ring from `head` to `next`, moving the head past the
    /// waits that ended before the first one that goes on: that one (the
    /// oldest), or `None` when an entry does not say (not written yet,
    /// overwritten, the head far behind) or nobody waits.
    fn ring_heir(&self, tid: u32, head: u32, next: u32) -> Option<(u32, u32)> {
        if next.wrapping_sub(head) & TICKET_MASK > ring_len(self.slots) {
            return None;
        }
        let waiting = tid | FUTEX_WAITERS;
        let hi = self.header(H_HI).load(SeqCst).min(self.slots);
        let mut t = head;
        while t != next {
            let k = ring_slot(self.ring_at(t).load(SeqCst), t).filter(|&k| k <= hi)?;
            // The waiter wrote the entry after its ticket: a slot that holds
            // another ticket now ended this wait (claimed, withdrawn, moved,
            // or reset by the broker, and maybe waits again since); one
            // that holds it and does not wait was scribbled on.
            if self.ticket(k).load(SeqCst) == t && self.state(k).load(SeqCst) == waiting {
                return Some((k, t));
            }
            let after = (t + 1) & TICKET_MASK;
            // Only from the front: every entry before this one ended too.
            let _ = self.ring_head().compare_exchange(t, after, SeqCst, SeqCst);
            t = after;
        }
        None
    }

    /// The oldest waiting slot, looking at every slot. Moves the ring's
    /// head (read as `head`, raw) to that slot's ticket if it was drawn
    /// before `next` was read, otherwise to `next`: no live wait has an
    /// older ticket, as every ticket drawn before that read belongs to a
    /// slot whose state said waiting before this look, which saw its
    /// ticket unless the slot was between its state and its ticket (a
    /// claimed value still in its ticket word). With a slot that reads
    /// waiting and claimed the head stays.
    fn scan_heir(&self, tid: u32, head: u32, next: u32) -> Option<(u32, u32)> {
        let waiting = tid | FUTEX_WAITERS;
        let hi = self.header(H_HI).load(SeqCst).min(self.slots);
        let mut unsure = false;
        // (slot, ticket, age from `next`; a ticket drawn after it: 0).
        let mut oldest: Option<(u32, u32, u32)> = None;
        for k in 1..=hi {
            if self.state(k).load(SeqCst) != waiting {
                continue;
            }
            let t = self.ticket(k).load(SeqCst);
            if t & CLAIMED != 0 {
                // Between its state and its ticket (what the ticket word
                // holds between waits is any claimed value, as far as
                // a client is told), or a claim not woken yet.
                unsure = true;
                continue;
            }
            let age = ticket_age(t, next);
            if oldest.map_or(true, |(_, _, a)| age > a) {
                oldest = Some((k, t, age));
            }
        }
        if !unsure {
            let to = match oldest {
                Some((_, t, age)) if age > 0 => t,
                _ => next,
            };
            if to != head {
                let _ = self.ring_head().compare_exchange(head, to, SeqCst, SeqCst);
            }
        }
        oldest.map(|(k, t, _)| (k, t))
    }

    /// The slots waiting with an unclaimed ticket, each with its ticket and
    /// its age from `next` (the ticket counter read before the scan); a
    /// ticket drawn after that read counts as the youngest (age 0).
    fn claimable(&self, tid: u32, next: u32) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        let waiting = tid | FUTEX_WAITERS;
        let hi = self.header(H_HI).load(SeqCst).min(self.slots);
        (1..=hi).filter_map(move |k| {
            if self.state(k).load(SeqCst) != waiting {
                return None;
            }
            let t = self.ticket(k).load(SeqCst);
            if t & CLAIMED != 0 {
                return None;
            }
            Some((k, t, ticket_age(t, next)))
        })
    }

    /// Passes word `i`, which holds `cur` (the giver's id, or [`FREE`]), to
    /// the oldest waiter, or frees it when nobody waits or the table is
    /// closed. `giver` is named in the claim and the gift.
    ///
    /// Three steps, each one compare-and-swap: claim the heir (its ticket
    /// word, `ticket → CLAIMED | giver`: no other giver, nor the broker,
    /// nor the heir's own withdrawal, can touch its wait from then on),
    /// move the token (`cur → gift(giver, heir)`), wake the heir (its
    /// state *waiting → woken*, then `FUTEX_WAKE`).
    pub fn hand_on(&self, i: u32, cur: u32, giver: u32) -> HandOn {
        self.hand_on_if(i, cur, giver, false)
    }

    /// The broker hands free word `i` to the oldest waiter whatever the
    /// gate says: a half-open table whose waiters the broker serves
    /// itself, one token at a time, while its clients give back to it.
    /// [`HandOn::Freed`] when nobody waits (the word stays free).
    pub fn hand_free_on(&self, i: u32) -> HandOn {
        self.hand_on_if(i, FREE, BROKER_GIVER, true)
    }

    /// [`hand_on`](Self::hand_on), looking for an heir while the gate is
    /// open (read again at every look), or at any gate with `any_gate`.
    fn hand_on_if(&self, i: u32, cur: u32, giver: u32, any_gate: bool) -> HandOn {
        let w = self.word(i);
        let mut cur = cur;
        loop {
            let heir = match self.tid() {
                Some(tid) if any_gate || self.is_open() => self.heir(tid).map(|(h, t)| (tid, h, t)),
                _ => None,
            };
            match heir {
                Some((tid, h, t)) => {
                    let waiting = tid | FUTEX_WAITERS;
                    let claim = CLAIMED | (giver & 0xffff);
                    if self
                        .ticket(h)
                        .compare_exchange(t, claim, SeqCst, SeqCst)
                        .is_err()
                    {
                        // Another giver, the broker or the heir itself got
                        // there first: look again.
                        continue;
                    }
                    let g = gift(giver, h);
                    if w.compare_exchange(cur, g, SeqCst, SeqCst).is_err() {
                        // The token is gone (taken while free, or taken
                        // back by the broker): the heir wakes to nothing
                        // and waits again.
                        if self
                            .state(h)
                            .compare_exchange(waiting, waiting | FUTEX_OWNER_DIED, SeqCst, SeqCst)
                            .is_ok()
                        {
                            self.wake_slot(h);
                        }
                        return if cur == FREE {
                            HandOn::Taken
                        } else {
                            HandOn::Lost
                        };
                    }
                    if self
                        .state(h)
                        .compare_exchange(waiting, waiting | FUTEX_OWNER_DIED, SeqCst, SeqCst)
                        .is_ok()
                    {
                        self.header64(H_HANDOFFS).fetch_add(1, SeqCst);
                        self.wake_slot(h);
                        return HandOn::Handed;
                    }
                    // The heir's slot was reset (its client left) or the
                    // broker died: the gift goes back, and on. If the
                    // broker freed it first, it hands it on itself.
                    if w.compare_exchange(g, cur, SeqCst, SeqCst).is_err() {
                        return HandOn::Handed;
                    }
                }
                None if cur == FREE => return HandOn::Freed,
                None => {
                    if w.compare_exchange(cur, FREE, SeqCst, SeqCst).is_err() {
                        return HandOn::Lost;
                    }
                    // Look once more: a waiter that came before the free.
                    cur = FREE;
                }
            }
        }
    }

    /// Turns the gift of `giver` to `me` into a word `me` holds: whether
    /// there was one.
    fn claim_gift(&self, me: u32, giver: u32) -> bool {
        let g = gift(giver, me);
        for i in 0..self.words() {
            let w = self.word(i);
            if w.load(SeqCst) == g && w.compare_exchange(g, me, SeqCst, SeqCst).is_ok() {
                self.count_taken();
                self.grants().fetch_add(1, SeqCst);
                return true;
            }
        }
        false
    }

    /// The index of a word `me` holds, if any.
    pub fn held_word(&self, me: u32) -> Option<u32> {
        (0..self.words()).find(|&i| self.word(i).load(SeqCst) == me)
    }

    /// Withdraws the wait of `me` (ticket `t`). Without `block`, a wait a
    /// claimer has not woken yet is left as it is ([`Leave::InFlight`]);
    /// with it, this waits for that wake-up (one compare-and-swap away).
    fn leave(&self, me: u32, tid: u32, t: u32, block: bool) -> Leave {
        // The ticket first: once it is claimed by this client itself, no
        // giver or broker can claim the wait.
        if self
            .ticket(me)
            .compare_exchange(t, WITHDRAWN, SeqCst, SeqCst)
            .is_ok()
        {
            let was = self.state(me).swap(IDLE, SeqCst);
            if was == tid | FUTEX_WAITERS | FUTEX_OWNER_DIED && self.claim_any_gift(me) {
                // Woken, with this wait unclaimed, by a giver that claimed
                // the wait of this slot's previous client (dead, the slot
                // given to this one) and gifted after: the gift is this
                // client's; nobody else would claim it.
                return Leave::Ended(Ended::Got);
            }
            return Leave::Withdrawn;
        }
        if !block && self.state(me).load(SeqCst) == tid | FUTEX_WAITERS {
            return Leave::InFlight;
        }
        Leave::Ended(self.ended(me, tid))
    }

    /// What a wait of `me` whose ticket was claimed ended in: waits for
    /// the claimer to wake it first (one compare-and-swap away, or the
    /// broker's repair if the claimer died; the broker's death ends it
    /// too).
    fn ended(&self, me: u32, tid: u32) -> Ended {
        let waiting = tid | FUTEX_WAITERS;
        let woken = waiting | FUTEX_OWNER_DIED;
        let st = self.state(me);
        if st.load(SeqCst) == waiting {
            // Sleeps on the state word from here on, whatever the wait
            // was: a claimer reads the wake word after its wake-up swap,
            // so either it sees 0 and wakes this word, or its swap came
            // first and the state is not *waiting* any more.
            self.wake_word(me).store(0, SeqCst);
        }
        loop {
            let v = st.load(SeqCst);
            if v != waiting {
                break;
            }
            let _ = self.seg.wait_word_for(self.state_index(me), waiting, None);
        }
        let claim = self.ticket(me).load(SeqCst);
        let was = st.load(SeqCst);
        let end = if claim == MOVED {
            (was == woken).then_some(Ended::Moved)
        } else if claim & CLAIMED != 0 && claim != WITHDRAWN && self.claim_gift(me, claim & 0xffff)
        {
            Some(Ended::Got)
        } else if was == woken && self.claim_any_gift(me) {
            // Woken by a giver that claimed this slot's previous client
            // (dead, the slot given to this one) and gifted after: the
            // gift is this client's now; nobody else claims it.
            Some(Ended::Got)
        } else {
            None
        };
        if was == woken {
            // The ticket word is claimed again before the state is idle:
            // no claim of this wait outlives it, and no giver claims the
            // next one before its ticket is drawn.
            self.ticket(me).store(WITHDRAWN, SeqCst);
            st.store(IDLE, SeqCst);
        }
        match end {
            Some(e) => e,
            // A giver whose token was gone meanwhile: wait again.
            None if was == woken => Ended::Again,
            None => Ended::Gone,
        }
    }

    /// Turns one gift to `me`, from anyone, into a word `me` holds.
    fn claim_any_gift(&self, me: u32) -> bool {
        for i in 0..self.words() {
            let w = self.word(i);
            let v = w.load(SeqCst);
            if as_gift(v).is_some_and(|(_, h)| h == me)
                && w.compare_exchange(v, me, SeqCst, SeqCst).is_ok()
            {
                self.count_taken();
                self.grants().fetch_add(1, SeqCst);
                return true;
            }
        }
        false
    }

    /// Whether the gift `(giver, heir)` belongs to no wait: the heir's
    /// ticket is not claimed by the giver and the heir is not woken. The
    /// broker frees such a gift (a giver that claimed a slot whose client
    /// then died, and gifted to the slot's next client).
    pub fn gift_is_stray(&self, giver: u32, heir: u32) -> bool {
        if !self.is_client(heir) {
            return true;
        }
        let woken = self.tid().map(|tid| tid | FUTEX_WAITERS | FUTEX_OWNER_DIED);
        self.ticket(heir).load(SeqCst) != CLAIMED | (giver & 0xffff)
            && Some(self.state(heir).load(SeqCst)) != woken
    }

    /// Waits in the table for a token, until `deadline` (`None`: no limit).
    /// The caller found no free word. Signals do not end the wait.
    ///
    /// # Errors
    ///
    /// The OS error of the futex wait (other than an interruption); the
    /// wait is withdrawn first.
    pub fn wait(&self, me: u32, deadline: Option<Instant>) -> io::Result<WaitEnd> {
        self.wait_nudging(me, deadline, &|| {})
    }

    /// [`wait`](Self::wait), calling `nudge` (which tells the broker) when
    /// the broker wants to hear of a wait that starts (the header's notify word).
    ///
    /// # Errors
    ///
    /// Those of [`wait`](Self::wait).
    pub fn wait_nudging(
        &self,
        me: u32,
        deadline: Option<Instant>,
        nudge: &dyn Fn(),
    ) -> io::Result<WaitEnd> {
        let Some(tid) = self.tid() else {
            return Ok(WaitEnd::Closed);
        };
        if !self.is_client(me) {
            return Ok(WaitEnd::Closed);
        }
        let since = Instant::now();
        let end = self.wait_from(me, tid, deadline, nudge)?;
        Ok(self.counted(end, since))
    }

    /// Counts a wait's end in the table's figures: its time when it ended
    /// in a token, a withdrawal at a deadline.
    fn counted(&self, end: WaitEnd, since: Instant) -> WaitEnd {
        match end {
            WaitEnd::Got(_) => {
                self.record_wait(u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX));
            }
            WaitEnd::TimedOut => {
                self.header(H_CANCELLED).fetch_add(1, SeqCst);
            }
            _ => {}
        }
        end
    }

    /// Starts a wait of `me`: its wake word (`pid`, or 0 for a wait on the
    /// state word), its state, its ticket. The ticket, or why no wait
    /// started.
    fn register(&self, me: u32, tid: u32, pid: u32) -> Result<u32, WaitEnd> {
        if !self.accepts_waits() {
            return Err(WaitEnd::Closed);
        }
        // The wake word before the state: a claimer reads it only after it
        // found the state *waiting*.
        self.wake_word(me).store(pid, SeqCst);
        // The state first, then the ticket: the ticket word holds a
        // claimed value between waits, so no giver or broker claims this
        // wait before its state says waiting, and a claim's wake-up
        // (waiting → woken) cannot fail.
        if self
            .state(me)
            .compare_exchange(IDLE, tid | FUTEX_WAITERS, SeqCst, SeqCst)
            .is_err()
        {
            // A slot the broker closed, or marked at its death.
            return Err(WaitEnd::Gone);
        }
        let t = self.draw_ticket(me);
        self.note_wait(me, t);
        Ok(t)
    }

    /// Draws the next ticket for the wait of `me` (its state already
    /// *waiting*) and stores it.
    fn draw_ticket(&self, me: u32) -> u32 {
        let t = self.ticket(0).fetch_add(1, SeqCst) & TICKET_MASK;
        self.ticket(me).store(t, SeqCst);
        t
    }

    /// Notes the wait of `me` with ticket `t` in the ring, after its
    /// ticket.
    fn note_wait(&self, me: u32, t: u32) {
        self.ring_at(t).store(ring_entry(t, me), SeqCst);
    }

    /// Calls `nudge` if the broker wants to hear of this take or wait
    /// (the header's notify word); `wait` says which it is.
    /// Called by a client after it took a word, and by every wait that
    /// starts.
    pub fn nudge_if_asked(&self, wait: bool, nudge: &dyn Fn()) {
        let word = self.header(H_NOTIFY);
        let n = word.load(SeqCst);
        if n & NOTIFY_COUNT == 0 || (n & NOTIFY_WAITS != 0 && !wait) {
            return;
        }
        let counted = word.fetch_update(SeqCst, SeqCst, |n| {
            if n & NOTIFY_WAITS != 0 && !wait {
                return None;
            }
            (n & NOTIFY_COUNT)
                .checked_sub(1)
                .map(|left| left | (n & !NOTIFY_COUNT))
        });
        if counted.is_ok_and(|was| was & NOTIFY_COUNT == 1) {
            nudge();
        }
    }

    /// After a give-back left a word free: whether this client is the one
    /// to tell the broker ([`NOTIFY_FREE`] was set, and it cleared it).
    /// The word is freed before this reads the notify word, and the broker
    /// writes the notify word before it reads the words (all sequentially
    /// consistent): either this sees the bit or the broker sees the word.
    fn free_notice_taken(&self) -> bool {
        let word = self.header(H_NOTIFY);
        word.load(SeqCst) & NOTIFY_FREE != 0
            && word.fetch_and(!NOTIFY_FREE, SeqCst) & NOTIFY_FREE != 0
    }

    /// Sets when clients tell the broker of a take or wait in the table
    /// (the header's notify word).
    pub fn set_notify(&self, notify: Notify) {
        let word = match notify {
            Notify::Never => 0,
            Notify::After(n) => n.clamp(1, NOTIFY_COUNT),
            Notify::FirstWait => NOTIFY_WAITS | 1,
            Notify::AfterOrFree(n) => NOTIFY_FREE | n.clamp(1, NOTIFY_COUNT),
        };
        self.header(H_NOTIFY).store(word, SeqCst);
    }

    /// Looks at the wait of `me` (ticket `t`) after it started and after
    /// each wake-up: the broker alive, the gate open, no free word that a
    /// giver freed unseen, not claimed. Without `block` it never sleeps: a
    /// wait claimed and not yet woken goes on ([`Step::Wait`]).
    fn check(&self, me: u32, tid: u32, t: u32, block: bool) -> Step {
        // Woken (the guard's id still in the state: the broker had not
        // died when this was read): the checks below would end the wait
        // in `ended` too, whatever they found, or, woken by a giver of
        // this slot's previous client with its own ticket unclaimed, in
        // the same end one ticket later.
        if self.state(me).load(SeqCst) == tid | FUTEX_WAITERS | FUTEX_OWNER_DIED {
            return Step::from(self.ended(me, tid));
        }
        let gone = self.state(0).load(SeqCst) != tid;
        let closed = !self.accepts_waits();
        // Only an open table has words to take (a half-open one's free
        // words are the broker's to take back).
        let free =
            !gone && self.is_open() && (0..self.words()).any(|i| self.word(i).load(SeqCst) == FREE);
        if gone || closed || free {
            return match self.leave(me, tid, t, block) {
                Leave::Withdrawn if gone => Step::End(WaitEnd::Gone),
                Leave::Withdrawn if closed => Step::End(WaitEnd::Closed),
                Leave::Withdrawn => match self.take(me, 0) {
                    Some(_) => Step::End(WaitEnd::Got(1)),
                    None => Step::Again,
                },
                Leave::Ended(e) => Step::from(e),
                Leave::InFlight => Step::Wait,
            };
        }
        let waiting = tid | FUTEX_WAITERS;
        if self.state(me).load(SeqCst) != waiting || self.ticket(me).load(SeqCst) != t {
            if !block && self.state(me).load(SeqCst) == waiting {
                // Claimed: the claimer's wake-up comes.
                return Step::Wait;
            }
            return Step::from(self.ended(me, tid));
        }
        Step::Wait
    }

    fn wait_from(
        &self,
        me: u32,
        tid: u32,
        deadline: Option<Instant>,
        nudge: &dyn Fn(),
    ) -> io::Result<WaitEnd> {
        let waiting = tid | FUTEX_WAITERS;
        let index = self.state_index(me);
        'register: loop {
            let t = match self.register(me, tid, 0) {
                Ok(t) => t,
                Err(end) => return Ok(end),
            };
            self.nudge_if_asked(true, nudge);
            loop {
                match self.check(me, tid, t, true) {
                    Step::End(end) => return Ok(end),
                    Step::Again => continue 'register,
                    Step::Wait => {}
                }
                let timeout = match deadline {
                    None => None,
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Ok(match self.leave(me, tid, t, true) {
                                Leave::Ended(e) => match Step::from(e) {
                                    Step::End(end) => end,
                                    _ => WaitEnd::TimedOut,
                                },
                                Leave::Withdrawn | Leave::InFlight => WaitEnd::TimedOut,
                            });
                        }
                        Some(left)
                    }
                };
                match self.seg.wait_word_for(index, waiting, timeout) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return match self.leave(me, tid, t, true) {
                            Leave::Ended(end) => match Step::from(end) {
                                Step::End(end) => Ok(end),
                                _ => Err(e),
                            },
                            Leave::Withdrawn | Leave::InFlight => Err(e),
                        };
                    }
                }
            }
        }
    }

    /// Starts a wait of `me` in the table for a process that waits in its
    /// own poll loop, `pid`: a giver wakes it with [`send_wake`] instead
    /// of `FUTEX_WAKE`. Never sleeps. The caller found no free word.
    /// Returns the wait, to look at with [`poll_check`](Self::poll_check)
    /// whenever the process wakes, or how it ended at once (a free word
    /// taken, the table closed, the broker gone).
    pub fn poll_start(&self, me: u32, pid: u32, nudge: &dyn Fn()) -> PollStep {
        let Some(tid) = self.tid() else {
            return PollStep::Ended(WaitEnd::Closed);
        };
        if !self.is_client(me) {
            return PollStep::Ended(WaitEnd::Closed);
        }
        self.poll_register(
            PollWait {
                t: 0,
                tid,
                pid,
                since: Instant::now(),
            },
            me,
            nudge,
        )
    }

    fn poll_register(&self, mut w: PollWait, me: u32, nudge: &dyn Fn()) -> PollStep {
        loop {
            w.t = match self.register(me, w.tid, w.pid) {
                Ok(t) => t,
                Err(end) => return PollStep::Ended(end),
            };
            self.nudge_if_asked(true, nudge);
            match self.check(me, w.tid, w.t, false) {
                Step::Wait => return PollStep::Waiting(w),
                Step::End(end) => return PollStep::Ended(self.counted(end, w.since)),
                Step::Again => {}
            }
        }
    }

    /// Looks whether the poll-loop wait `w` of `me` has ended, without
    /// sleeping.
    pub fn poll_check(&self, me: u32, w: PollWait, nudge: &dyn Fn()) -> PollStep {
        match self.check(me, w.tid, w.t, false) {
            Step::Wait => PollStep::Waiting(w),
            Step::End(end) => PollStep::Ended(self.counted(end, w.since)),
            // Woken with nothing: wait again.
            Step::Again => self.poll_register(w, me, nudge),
        }
    }

    /// Withdraws the poll-loop wait `w` of `me`: `None` when withdrawn
    /// before anything came, otherwise how it ended first (a token handed
    /// over: the caller holds it). A claimer's wake-up that is one step
    /// away is waited for.
    pub fn poll_withdraw(&self, me: u32, w: PollWait) -> Option<WaitEnd> {
        match self.leave(me, w.tid, w.t, true) {
            Leave::Withdrawn | Leave::InFlight => {
                self.header(H_CANCELLED).fetch_add(1, SeqCst);
                None
            }
            Leave::Ended(e) => match Step::from(e) {
                Step::End(end) => Some(self.counted(end, w.since)),
                Step::Wait | Step::Again => None,
            },
        }
    }

    // ---- broker side -----------------------------------------------------

    /// Puts the table under a guard: from now on clients may wait in it,
    /// and the broker's death, however it comes, ends their waits. Keep
    /// the guard for as long as the table.
    ///
    /// # Errors
    ///
    /// Those of [`Segment::guard`] (`Unsupported` but on Linux).
    pub fn guard(&self) -> io::Result<DeathGuard> {
        let states: Vec<u32> = (0..=self.slots).map(|k| self.state_index(k)).collect();
        let guard = self.seg.guard(&states)?;
        let tid = guard.tid();
        self.state(0).store(tid, SeqCst);
        self.header(H_TID).store(tid, SeqCst);
        Ok(guard)
    }

    /// Writes back what only the broker may write: the header's layout
    /// words, the guard's id and slot 0's life word (`guarded`: the id
    /// the guard has, or `None`), and the highest client id. Any client
    /// can scribble over them; a client that then maps the table finds its
    /// layout again, and waiters find the broker alive.
    pub fn repair(&self, guarded: Option<u32>, hi: u32) {
        self.header(H_MAGIC).store(MAGIC, SeqCst);
        self.header(H_LAYOUT).store(LAYOUT, SeqCst);
        self.header(H_WORDS).store(self.words, SeqCst);
        self.header(H_SLOTS).store(self.slots, SeqCst);
        self.header(H_TID).store(guarded.unwrap_or(0), SeqCst);
        self.header(H_PIDNS)
            .store(herdless_platform::pid_namespace().unwrap_or(0), SeqCst);
        if let Some(tid) = guarded {
            self.state(0).store(tid, SeqCst);
        }
        self.set_hi(hi);
    }

    /// Notes the highest client id in use.
    pub fn set_hi(&self, hi: u32) {
        self.header(H_HI).store(hi.min(self.slots), SeqCst);
    }

    /// Resets slot `k` for its next client (`shut`: for nobody, its
    /// client's connection was closed while its process may still run),
    /// and wakes a process still asleep on it: it finds the wait over and
    /// reads why from its socket.
    pub fn clear_slot(&self, k: u32, shut: bool) {
        if self.is_client(k) {
            let was = self.state(k).swap(if shut { SHUT } else { IDLE }, SeqCst);
            self.ticket(k).store(WITHDRAWN, SeqCst);
            if was != IDLE {
                let _ = self.seg.wake_all(self.state_index(k));
            }
        }
    }

    /// The slots waiting now, oldest ticket first, each with its ticket.
    pub fn waiters(&self) -> Vec<(u32, u32)> {
        match self.tid() {
            Some(tid) => self.waiting_slots(tid),
            None => Vec::new(),
        }
    }

    /// Whether client `k`'s slot waits now.
    pub fn is_waiting(&self, k: u32) -> bool {
        self.is_client(k)
            && self
                .tid()
                .is_some_and(|tid| self.state(k).load(SeqCst) == tid | FUTEX_WAITERS)
    }

    /// How many slots wait now.
    pub fn waiting_count(&self) -> usize {
        match self.tid() {
            Some(tid) => {
                let next = self.ticket(0).load(SeqCst) & TICKET_MASK;
                self.claimable(tid, next).count()
            }
            None => 0,
        }
    }

    /// Ends the wait of slot `k` (ticket `t`) without a gift, the broker
    /// queueing it instead: whether it was still waiting.
    pub fn move_waiter(&self, k: u32, t: u32) -> bool {
        let Some(tid) = self.tid() else {
            return false;
        };
        if !self.is_client(k)
            || self
                .ticket(k)
                .compare_exchange(t, MOVED, SeqCst, SeqCst)
                .is_err()
        {
            return false;
        }
        let waiting = tid | FUTEX_WAITERS;
        let moved = self
            .state(k)
            .compare_exchange(waiting, waiting | FUTEX_OWNER_DIED, SeqCst, SeqCst)
            .is_ok();
        if moved {
            self.wake_moved(k);
        } else {
            self.wake_slot(k);
        }
        moved
    }

    /// Finishes what giver `g`, now dead, left half done: a wait it
    /// claimed and gifted is woken; a wait it claimed without a gift is
    /// moved to the broker's queue (the slots returned, to queue); a gift
    /// of its whose heir is not waiting for it is freed (the words
    /// returned, to hand on).
    pub fn finish_giver(&self, g: u32) -> (Vec<u32>, Vec<u32>) {
        self.finish_giver_waking(g, true)
    }

    /// [`finish_giver`](Self::finish_giver) again, for a giver already
    /// finished once: a heir it gifted and woke, or that the first pass
    /// woke, is not woken again (it may be busy and take its gift later;
    /// one wake-up is all it needs, as the wait word or the signal's
    /// eventfd keeps it). What is still half done is finished as the
    /// first pass does. A giver dead when it was finished first can have
    /// done nothing since; one whose connection the broker closed while
    /// its process ran on (a client cut off for breaking the rules) could
    /// still mark a heir woken and die before its wake-up call, and that
    /// heir is not woken here: a rule-breaker can stall a waiter in other
    /// ways too (by writing its state word).
    pub fn finish_giver_again(&self, g: u32) -> (Vec<u32>, Vec<u32>) {
        self.finish_giver_waking(g, false)
    }

    /// Both of the above: `rewake` wakes a gifted heir already woken.
    fn finish_giver_waking(&self, g: u32, rewake: bool) -> (Vec<u32>, Vec<u32>) {
        let mut moved = Vec::new();
        let mut freed = Vec::new();
        let Some(tid) = self.tid() else {
            return (moved, freed);
        };
        let waiting = tid | FUTEX_WAITERS;
        let woken = waiting | FUTEX_OWNER_DIED;
        let claim = CLAIMED | (g & 0xffff);
        let mut claimed_by_g = Vec::new();
        for k in 1..=self.slots {
            if self.ticket(k).load(SeqCst) == claim {
                claimed_by_g.push(k);
            }
        }
        for i in 0..self.words() {
            let v = self.word(i).load(SeqCst);
            let Some((giver, h)) = as_gift(v) else {
                continue;
            };
            if giver != (g & 0x7fff) {
                continue;
            }
            let mut woke_now = false;
            if claimed_by_g.contains(&h) && self.state(h).load(SeqCst) == waiting {
                woke_now = self
                    .state(h)
                    .compare_exchange(waiting, woken, SeqCst, SeqCst)
                    .is_ok();
            }
            if claimed_by_g.contains(&h) && self.state(h).load(SeqCst) == woken {
                if rewake || woke_now {
                    self.wake_slot(h);
                }
                claimed_by_g.retain(|&k| k != h);
            } else if self.free_gift(i, v) {
                freed.push(i);
            }
        }
        // Claimed, never gifted: the broker queues the wait.
        for k in claimed_by_g {
            if self.state(k).load(SeqCst) == waiting
                && self
                    .ticket(k)
                    .compare_exchange(claim, MOVED, SeqCst, SeqCst)
                    .is_ok()
                && self
                    .state(k)
                    .compare_exchange(waiting, woken, SeqCst, SeqCst)
                    .is_ok()
            {
                moved.push(k);
                self.wake_moved(k);
            } else {
                self.wake_slot(k);
            }
        }
        (moved, freed)
    }

    fn free_gift(&self, i: u32, seen: u32) -> bool {
        self.word(i)
            .compare_exchange(seen, FREE, SeqCst, SeqCst)
            .is_ok()
    }

    /// Opens the table to takers.
    pub fn open_gate(&self) {
        self.header(GATE).store(0, SeqCst);
    }

    /// Half-opens the table ([`HALF_OPEN`]): takers fail and givers tell
    /// the broker, as when it is closed, and waits may start. The caller
    /// then reads every lent word.
    pub fn half_open_gate(&self) {
        self.header(GATE).store(HALF_OPEN, SeqCst);
    }

    /// Closes the table: from now on takers fail and givers tell the
    /// broker. The caller then reads every lent word.
    pub fn close_gate(&self) {
        self.header(GATE).store(1, SeqCst);
    }

    /// Lends word `i` (which the broker knows to be [`OUT`]): to the
    /// oldest waiter, or free.
    pub fn lend(&self, i: u32) {
        self.word(i).store(FREE, SeqCst);
        self.hand_on(i, FREE, BROKER_GIVER);
    }

    /// Takes word `i` back if it is free. Whatever a client wrote into a
    /// word the broker lent, the token stays the broker's to count.
    pub fn take_back(&self, i: u32) -> bool {
        self.word(i)
            .compare_exchange(FREE, OUT, SeqCst, SeqCst)
            .is_ok()
    }

    /// Frees word `i` if it still reads `owner` (an id or a gift); counted
    /// out of the tokens in use when it was an id.
    pub fn reclaim(&self, i: u32, owner: u32) -> bool {
        let done = self
            .word(i)
            .compare_exchange(owner, FREE, SeqCst, SeqCst)
            .is_ok();
        if done && as_gift(owner).is_none() {
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

    /// Waits in the table that ended in a token (counted with their time).
    pub fn waits_got(&self) -> u64 {
        let x = extra_base(self.words, self.slots);
        (0..crate::stats::BUCKETS as u32)
            .map(|b| u64::from(self.seg.word(x + X_COUNTS + b).load(SeqCst)))
            .sum()
    }

    /// Notes a wait in the table that ended in a token after `ns`.
    fn record_wait(&self, ns: u64) {
        let x = extra_base(self.words, self.slots);
        let bucket = crate::stats::index(ns) as u32;
        self.seg.word(x + X_COUNTS + bucket).fetch_add(1, SeqCst);
        self.seg.word64(x + X_SUM).fetch_add(ns, SeqCst);
        self.seg.word64(x + X_MAX).fetch_max(ns, SeqCst);
    }

    /// Adds the waits in the table that ended in a token to `h`. Clients
    /// write the figures: a count is believed as a count, nothing more.
    pub fn add_waits_to(&self, h: &mut crate::stats::Histogram) {
        let x = extra_base(self.words, self.slots);
        let counts: Vec<u64> = (0..crate::stats::BUCKETS as u32)
            .map(|b| u64::from(self.seg.word(x + X_COUNTS + b).load(SeqCst)))
            .collect();
        h.add_buckets(
            &counts,
            u128::from(self.seg.word64(x + X_SUM).load(SeqCst)),
            self.seg.word64(x + X_MAX).load(SeqCst),
        );
    }

    /// Waiters woken with a token handed to them (counted by the givers).
    pub fn handoffs(&self) -> u64 {
        self.header64(H_HANDOFFS).load(SeqCst)
    }

    /// Waits in the table withdrawn at their deadline (clients count
    /// them, modulo 2³²).
    pub fn waits_cancelled(&self) -> u32 {
        self.header(H_CANCELLED).load(SeqCst)
    }
}

impl Table {
    /// The table's memory file, to pass to a client: `Some` for the
    /// broker's table, `None` for a client's, which closed it once mapped.
    pub fn file(&self) -> Option<BorrowedFd<'_>> {
        self.seg.file()
    }
}

#[cfg(test)]
mod tests;
