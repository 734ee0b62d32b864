//! The broker's side of the shared token table (`crate::fast`): which
//! clients map it, lending free tokens to it while nothing but FIFO order
//! would decide who gets them, taking them back when that changes, taking
//! back what a closed connection held, and checking what it reads.
//!
//! The table is one client of the pool (like the classic bridge): the
//! tokens lent to it, free or held by a client of the table, are that
//! client's in the pool's books, so the pool's conservation holds as it
//! is. The broker never trusts the table: it keeps its own list of the
//! words it lent, reads every word as a value that may be anything, frees
//! a lent word held by an id that is not a connected client of the table,
//! and cuts off a client found holding a word it was never lent.

use std::collections::HashMap;
use std::os::fd::AsFd;

use mio::Token;

use super::Broker;
use crate::fast::{as_gift, HandOn, Table, BROKER_GIVER, FREE, MAX_SLOTS, OUT};
use crate::log;
use crate::log::Level;
use crate::pool::{ClientId, ClientInfo, SlotKey};
use crate::protocol::Reply;

/// The most words a table has: lending more tokens than this leaves the
/// rest on the socket path.
pub(super) const MAX_TABLE_WORDS: u32 = 4096;

/// What the broker keeps for the table.
pub(super) struct FastState {
    /// Lets clients wait in the table (dropped before the table: it
    /// names the table's words).
    guard: Option<herdless_platform::DeathGuard>,
    pub(super) table: Table,
    /// The words the broker lent (its own books; the table may say
    /// anything).
    lent: Vec<bool>,
    lent_count: u32,
    /// The table's client in the pool.
    client: ClientId,
    /// Table owner id (its slot, 1 to the table's slots) → connection.
    owners: HashMap<u32, Token>,
    /// Slots of connections the broker closed while their process may
    /// still run: never given to another client.
    shut: std::collections::HashSet<u32>,
    /// The slots that table clients name, with how many name each: while
    /// one of them is free, the table stays closed (the slot goes first,
    /// ARCHITECTURE §4.5).
    named_slots: HashMap<SlotKey, u32>,
    /// Which slot each table client names.
    names: HashMap<ClientId, SlotKey>,
    /// What the pool was last told each client holds from the table
    /// (`Pool::set_table_held`, for caps).
    told_held: HashMap<ClientId, u32>,
    /// The table must be read: a client gave back while it was closed, a
    /// client of it closed, or the gate just closed.
    dirty: bool,
    /// Tokens lent to the table (pool grants to its client).
    pub(super) lends: u64,
    /// Words freed from closed connections.
    pub(super) reclaimed: u64,
    /// Clients cut off for breaking the table's rules.
    pub(super) cut_off: u64,
    /// Words held by connections the broker closed at its stop.
    pub(super) held_at_shutdown: u64,
    /// What the broker has added to the table's count of tokens in use.
    base_in_use: u32,
    /// Waits in the table the broker moved to its queue.
    pub(super) moved: u64,
    /// While the table is half-open and clients wait in it: the native
    /// grants counted when the broker first saw them (their wait behind
    /// the broker's queue is bounded by that).
    half_waiters_since: Option<u64>,
    /// Owner ids of clients gone whose half-done hand-offs were finished
    /// once (their heirs woken): a later sweep that still finds a gift of
    /// theirs, not yet taken, wakes no heir again.
    finished_givers: std::collections::HashSet<u32>,
}

impl FastState {
    /// A table of `words` words, its client connected to `pool`.
    pub(super) fn new(pool: &mut crate::pool::Pool, words: u32) -> std::io::Result<FastState> {
        let table = Table::create(words, MAX_SLOTS)?;
        // Without a guard (every OS but Linux, or `HERDLESS_HANDOFF=0`)
        // nobody waits in the table: a client that finds it empty asks
        // the broker.
        let guard = if std::env::var_os(crate::fast::HANDOFF_ENV).is_some_and(|v| v == "0") {
            None
        } else {
            match table.guard() {
                Ok(g) => Some(g),
                Err(e) => {
                    log!(
                        Level::Debug,
                        "no waiting in the shared table: {e}; waits go to the broker"
                    );
                    None
                }
            }
        };
        let client = pool.connect(ClientInfo {
            pid: std::process::id(),
            borrows: None,
            observer: false,
            label: "table",
            internal: true,
        });
        Ok(FastState {
            guard,
            table,
            lent: vec![false; words as usize],
            lent_count: 0,
            client,
            owners: HashMap::new(),
            shut: std::collections::HashSet::new(),
            named_slots: HashMap::new(),
            names: HashMap::new(),
            told_held: HashMap::new(),
            dirty: false,
            lends: 0,
            reclaimed: 0,
            cut_off: 0,
            held_at_shutdown: 0,
            base_in_use: 0,
            moved: 0,
            half_waiters_since: None,
            finished_givers: std::collections::HashSet::new(),
        })
    }

    /// The table's client in the pool.
    pub(super) fn client(&self) -> ClientId {
        self.client
    }

    /// Tokens lent to the table now, free or held.
    pub(super) fn lent(&self) -> u32 {
        self.lent_count
    }

    /// Clients connected to the table.
    pub(super) fn clients(&self) -> usize {
        self.owners.len()
    }

    /// Lent words now free, and lent words held.
    pub(super) fn free_and_held(&self) -> (u32, u32) {
        let mut free = 0;
        let mut held = 0;
        for i in 0..self.table.words() {
            if self.lent[i as usize] {
                match self.table.word(i).load(std::sync::atomic::Ordering::SeqCst) {
                    FREE => free += 1,
                    v if self.owners.contains_key(&v) => held += 1,
                    v if as_gift(v).is_some_and(|(_, h)| self.owners.contains_key(&h)) => held += 1,
                    _ => {}
                }
            }
        }
        (free, held)
    }
}

impl FastState {
    /// Client `id` leaves the table: the slot it names counts one client
    /// less.
    fn forget_name(&mut self, id: ClientId) {
        if let Some(key) = self.names.remove(&id) {
            if let Some(n) = self.named_slots.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.named_slots.remove(&key);
                }
            }
        }
    }
}

impl Broker {
    /// Admits connection `token` (client `id`) to the table: its owner id,
    /// or 0 when there is no table.
    fn fast_admit(&mut self, token: Token, id: ClientId) -> u32 {
        let key = self.slot_named_in_table(token, id);
        let Some(fast) = self.fast.as_mut() else {
            return 0;
        };
        let Some(owner) = (1..=fast.table.slots())
            .find(|k| !fast.owners.contains_key(k) && !fast.shut.contains(k))
        else {
            // Every slot is taken: this client uses the socket.
            return 0;
        };
        fast.table.clear_slot(owner, false);
        fast.owners.insert(owner, token);
        fast.finished_givers.remove(&owner);
        fast.table
            .set_hi(fast.owners.keys().copied().max().unwrap_or(0));
        if let Some(key) = key {
            *fast.named_slots.entry(key).or_insert(0) += 1;
            fast.names.insert(id, key);
        }
        owner
    }

    /// The slot that client `id` (connection `token`) names for the
    /// table's gate: the one it may borrow, unless it is a runner that
    /// borrows its recipe's slot as its implicit token
    /// (`HelloFlags::RUNNER`), which its hello asked for at the broker and
    /// which it never asks for again: a free slot of its keeps the table
    /// closed for nobody (closed, each runner's give-back of it at its end
    /// would move every wait in the table to the broker's queue).
    fn slot_named_in_table(&self, token: Token, id: ClientId) -> Option<SlotKey> {
        let runner = self.conns.get(&token).is_some_and(|c| c.runner);
        self.pool.borrows(id).filter(|_| !runner)
    }

    /// Answers a hello that asked for the table: `Segment`, with the
    /// table's descriptor when the client gets it. The `Welcome` is
    /// already queued: it must reach the socket before the descriptor, so
    /// a client without a table is told so in the stream instead.
    pub(super) fn send_segment(&mut self, token: Token, id: ClientId) {
        let owner = self.fast_admit(token, id);
        if owner != 0 && self.slot_named_in_table(token, id).is_some() {
            // A slot it names may be free: the table closes before the
            // client can map it, so that its first take asks the broker,
            // which lends the slot rather than a shared token.
            self.fast_balance();
        }
        let sent = owner != 0 && {
            let words = self.fast.as_ref().map_or(0, |f| f.table.total());
            let fast = self.fast.as_ref();
            let conn = self.conns.get_mut(&token);
            match (fast, conn) {
                (Some(fast), Some(conn)) => {
                    let before = conn.tx.len();
                    let flushed = super::flush(conn).is_ok() && conn.tx.is_empty();
                    self.output_total -= before - conn.tx.len();
                    let mut frame = Vec::new();
                    Reply::Segment { owner, words }.encode(&mut frame);
                    flushed
                        && match fast.table.file().map(|file| {
                            herdless_platform::send_with_fd(conn.stream.as_fd(), &frame, file)
                        }) {
                            Some(Ok(n)) => {
                                conn.tx.extend_from_slice(&frame[n..]);
                                self.output_total += frame.len() - n;
                                true
                            }
                            Some(Err(_)) | None => false,
                        }
                }
                _ => false,
            }
        };
        if sent {
            if let Some(conn) = self.conns.get_mut(&token) {
                conn.fast_owner = owner;
            }
            self.dirty.push(token);
            // It may hold tokens without the broker seeing a grant: its
            // process is watched for as long as it is connected, so a fork
            // keeping the socket does not keep its tokens (§4.6).
            self.watch_holder(token);
            return;
        }
        if owner != 0 {
            if let Some(fast) = self.fast.as_mut() {
                fast.owners.remove(&owner);
                fast.forget_name(id);
            }
        }
        self.send(token, &Reply::Segment { owner: 0, words: 0 });
    }

    /// Whether the table may be open: nothing but FIFO order would decide
    /// who gets a free token (no waiter, cap, admission limit, shrink,
    /// abort or stop), a classic bridge leaves the free pool to it, and no
    /// client of the table names a free slot.
    fn fast_may_open(&self) -> bool {
        let Some(fast) = self.fast.as_ref() else {
            return false;
        };
        // Every free token must fit in the table: a client waiting in it
        // would not see one left in the pool.
        self.pool.plain()
            && self
                .bridge
                .as_ref()
                .map_or(true, |b| b.leaves_pool_to_table(&self.pool))
            && self.pool.free() <= fast.table.words() - fast.lent_count
            && fast
                .named_slots
                .keys()
                .all(|&key| !self.pool.slot_lendable(key))
    }

    /// Whether the table may be half-open (`crate::fast::HALF_OPEN`):
    /// it may not be open only because waiters are queued at the broker
    /// (under a classic bridge, the bridge's ask for an offer among them),
    /// and clients may wait in it. Never with the queue empty: the table's
    /// waiters would then wait for nobody (but while the broker serves
    /// them itself, [`fast_may_serve`](Self::fast_may_serve)). New waits
    /// then start in the table rather than at the broker, so the broker's
    /// queue drains and the table opens again, however hard clients
    /// contend.
    fn fast_may_half_open(&self) -> bool {
        let Some(fast) = self.fast.as_ref() else {
            return false;
        };
        fast.guard.is_some()
            && self.pool.waiting() > 0
            && self.pool.plain_but_queue()
            && self
                .bridge
                .as_ref()
                .map_or(true, crate::bridge::Bridge::table_mode)
            && fast
                .named_slots
                .keys()
                .all(|&key| !self.pool.slot_lendable(key))
    }

    /// Whether the table may be half-open with the broker serving its
    /// waiters itself: the classic bridge's offer for waiting natives is
    /// out, and nothing else keeps the table from opening. Clients give
    /// back to the broker meanwhile (the offer's rules count releases as
    /// broker events), and the broker hands each token to the oldest
    /// waiter in the table: their waits stay where they are.
    pub(super) fn fast_may_serve(&self) -> bool {
        let Some(fast) = self.fast.as_ref() else {
            return false;
        };
        // Every free token must fit in the table, as for opening: one that
        // does not would stay in the pool while natives wait there.
        fast.guard.is_some()
            && self.pool.plain()
            && self.pool.free() <= fast.table.words() - fast.lent_count
            && self
                .bridge
                .as_ref()
                .is_some_and(|b| b.offer_out_to_waiters(&self.pool))
            && fast
                .named_slots
                .keys()
                .all(|&key| !self.pool.slot_lendable(key))
    }

    /// Whether the pool's queue holds the classic bridge's ask for an
    /// offer alone: it goes ahead of the waits in the table, which stay
    /// there (the broker serves them once the offer is out).
    fn fast_offer_alone_queued(&self) -> bool {
        self.pool.waiting() == 1
            && self
                .bridge
                .as_ref()
                .is_some_and(crate::bridge::Bridge::offer_queued)
    }

    /// Lends free pool tokens to the half-open table and hands each to the
    /// oldest waiter there, while both last (see
    /// [`fast_may_serve`](Self::fast_may_serve)). A word nobody takes
    /// goes back to the pool.
    fn fast_serve_waiters(&mut self) {
        if self.pool.free() > 0 {
            // As before lending to an open table: what the broker holds
            // back counts down first, so the table's peak never sees a
            // token twice.
            self.note_in_use();
        }
        loop {
            let Some(fast) = self.fast.as_ref() else {
                return;
            };
            if self.pool.free() == 0
                || fast.lent_count >= fast.table.words()
                || fast.table.waiting_count() == 0
            {
                return;
            }
            let Some(i) = fast.lent.iter().position(|l| !l) else {
                return;
            };
            let client = fast.client;
            let free = self.pool.free();
            if self.pool.try_acquire(client).is_err() || self.pool.free() == free {
                return;
            }
            // The grant's effect lends word `i` (the first not lent).
            self.apply_effects();
            let Some(fast) = self.fast.as_mut() else {
                return;
            };
            if !fast.lent[i] || fast.table.hand_free_on(i as u32) == HandOn::Handed {
                continue;
            }
            // Its waiter withdrew meanwhile: the word goes back.
            self.fast_take_back_word(i as u32);
            return;
        }
    }

    /// Brings the table in line with the pool: open and lend free tokens,
    /// half-open or close and take back free words. Called after every
    /// event.
    pub(super) fn fast_balance(&mut self) {
        let open = self.fast_may_open();
        let serve = !open && self.fast_may_serve();
        let half = !open && !serve && self.fast_may_half_open();
        let offer_alone = half && self.fast_offer_alone_queued();
        let capacity = u64::from(self.pool.capacity());
        let grants = self.native_grants;
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        if !half || offer_alone {
            fast.half_waiters_since = None;
        }
        if serve {
            let was_open = fast.table.is_open();
            fast.table.half_open_gate();
            // After the gate: a giver that read it open handed its word on
            // or freed it, and the reading here takes a free one back
            // (Dekker, as for closing); the pool's free tokens then go to
            // the waiters, oldest first.
            if was_open || fast.dirty {
                self.fast_sweep(true);
                // Words freed by that sweep (a dead giver's) come back too.
                if self.fast.as_ref().is_some_and(|f| f.dirty) {
                    self.fast_sweep(true);
                }
            }
            self.fast_serve_waiters();
        } else if open {
            // What the broker holds back counts down in the table's count
            // before a lent word can be taken: the count's peak never
            // sees a token twice.
            self.note_in_use();
            let Some(fast) = self.fast.as_mut() else {
                return;
            };
            let was_open = fast.table.is_open();
            fast.table.open_gate();
            // Opening, the words are read after the gate is written: a
            // giver that freed a word while the table was half-open and
            // then read it open told nobody (Dekker, the other way round
            // from closing), and the read here hands that word on.
            if !was_open || fast.dirty {
                self.fast_sweep(false);
            }
            while let Some(fast) = self.fast.as_ref() {
                let client = fast.client;
                if self.pool.free() == 0 || fast.lent_count >= fast.table.words() {
                    break;
                }
                let free = self.pool.free();
                if self.pool.try_acquire(client).is_err() || self.pool.free() == free {
                    break;
                }
                // The grant's effect lends a word (`fast_on_grant`).
                self.apply_effects();
            }
        } else if half {
            let was_open = fast.table.is_open();
            fast.table.half_open_gate();
            // Waits from before are older than the ask that closed the
            // table: they queue ahead of it. Waits that start now stay in
            // the table until its next opening, and join the queue, in
            // ticket order, if the queue outlasts a round of grants
            // (capacity) after the broker first sees them.
            let mv = if offer_alone {
                // The bridge's offer goes first; the waits stay here and
                // are served as soon as it is out (`fast_may_serve`).
                false
            } else if was_open {
                true
            } else if fast.table.waiting_count() == 0 {
                fast.half_waiters_since = None;
                false
            } else {
                let since = *fast.half_waiters_since.get_or_insert(grants);
                grants.saturating_sub(since) > capacity
            };
            if mv {
                fast.half_waiters_since = None;
                self.fast_move_waiters();
            }
            if let Some(fast) = self.fast.as_ref() {
                if was_open || fast.dirty {
                    self.fast_sweep(true);
                }
            }
        } else {
            let was_open = fast.table.is_open();
            fast.table.close_gate();
            // After the gate: a client that starts waiting later sees it
            // closed and asks the broker itself.
            self.fast_move_waiters();
            if let Some(fast) = self.fast.as_ref() {
                if was_open || fast.dirty {
                    self.fast_sweep(true);
                }
            }
        }
    }

    /// Moves every wait in the closed table to the pool's queue, oldest
    /// ticket first: the client gets its grant over the socket.
    fn fast_move_waiters(&mut self) {
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        let mut queued = Vec::new();
        for (k, t) in fast.table.waiters() {
            if fast.owners.contains_key(&k) && fast.table.move_waiter(k, t) {
                queued.push(k);
            }
        }
        self.fast_queue_moved(queued);
    }

    /// Queues an `Acquire` for each client of these slots, whose wait in
    /// the table the broker ended without a gift.
    fn fast_queue_moved(&mut self, slots: Vec<u32>) {
        if slots.is_empty() {
            return;
        }
        let now = self.now();
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        let mut clients = Vec::new();
        for k in slots {
            let conn = fast.owners.get(&k).copied();
            let client = conn.and_then(|t| self.conns.get(&t)).and_then(|c| c.client);
            if let (Some(token), Some(client)) = (conn, client) {
                fast.moved += 1;
                clients.push((token, client));
            }
        }
        let mut cut = Vec::new();
        for (token, client) in clients {
            // A slot that keeps claiming to wait (its client writes it)
            // queues no more than a connection may.
            if self.pool.pending(client) >= super::MAX_PENDING_ACQUIRES {
                cut.push(token);
                continue;
            }
            let _ = self.pool.acquire(client, now);
        }
        self.apply_effects();
        for token in cut {
            self.close(
                token,
                Some(format!(
                    "more than {} acquires waiting on one connection",
                    super::MAX_PENDING_ACQUIRES
                )),
            );
        }
    }

    /// The pool granted the table's client a token: lend one word.
    pub(super) fn fast_on_grant(&mut self) {
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        match fast.lent.iter().position(|l| !l) {
            Some(i) => {
                fast.lent[i] = true;
                fast.lent_count += 1;
                fast.lends += 1;
                fast.table.lend(i as u32);
            }
            None => {
                // No word left (cannot happen: the caller checks); the
                // token goes back.
                let (client, now) = (fast.client, self.now());
                let _ = self.pool.release(client, now);
            }
        }
    }

    /// Reads every word: frees lent words held by ids that are no client of
    /// the table, takes free lent words back into the pool when `take_back`,
    /// puts `OUT` back in words the broker did not lend and cuts off a
    /// client found in one.
    pub(super) fn fast_sweep(&mut self, take_back: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.now();
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        fast.dirty = false;
        fast.table.repair(
            fast.guard.as_ref().map(herdless_platform::DeathGuard::tid),
            fast.owners.keys().copied().max().unwrap_or(0),
        );
        let mut returned = 0;
        let mut cut = Vec::new();
        let mut dead_givers = std::collections::BTreeSet::new();
        let mut held: HashMap<u32, u32> = HashMap::new();
        for i in 0..fast.table.words() {
            let v = fast.table.word(i).load(SeqCst);
            if fast.lent[i as usize] {
                match as_gift(v) {
                    Some((_, h)) if !fast.owners.contains_key(&h) => {
                        fast.table.reclaim(i, v);
                    }
                    Some((g, _)) if g != BROKER_GIVER && !fast.owners.contains_key(&g) => {
                        // Its giver died between its steps.
                        dead_givers.insert(g);
                    }
                    Some((g, h)) if fast.table.gift_is_stray(g, h) => {
                        // A giver between its steps has the heir's ticket
                        // claimed throughout: this one belongs to no wait.
                        fast.table.reclaim(i, v);
                    }
                    Some(_) => {}
                    None if v != FREE && v != OUT && !fast.owners.contains_key(&v) => {
                        log!(
                            Level::Warn,
                            "shared table word {i} names owner {v}, which is no client; freed"
                        );
                        fast.table.reclaim(i, v);
                    }
                    None => {}
                }
                let v = fast.table.word(i).load(SeqCst);
                if v == OUT || (take_back && fast.table.take_back(i)) {
                    fast.table.word(i).store(OUT, SeqCst);
                    fast.lent[i as usize] = false;
                    fast.lent_count -= 1;
                    returned += 1;
                } else if v == FREE {
                    if !take_back {
                        // A word freed by the broker (a dead client's)
                        // goes to the oldest waiter.
                        fast.table.hand_on(i, FREE, BROKER_GIVER);
                    }
                } else {
                    let owner = as_gift(v).map_or(v, |(_, h)| h);
                    *held.entry(owner).or_insert(0) += 1;
                }
            } else if v != OUT {
                // An id in a word never lent: its client wrote it. A gift
                // there may name anyone: nobody is cut off for it.
                if as_gift(v).is_none() {
                    if let Some(&token) = fast.owners.get(&v) {
                        cut.push(token);
                    }
                }
                fast.table.restore_out(i, v);
            }
        }
        let mut moved = Vec::new();
        for g in dead_givers {
            let (m, freed) = if fast.finished_givers.insert(g) {
                fast.table.finish_giver(g)
            } else {
                // Its heir was woken: it takes the gift when it runs.
                fast.table.finish_giver_again(g)
            };
            moved.extend(m);
            // Freed words are handed on by the next read of the table.
            if !freed.is_empty() {
                fast.dirty = true;
            }
        }
        // Caps count what each client holds from the table: the pool
        // learns it before the returned tokens reach its waiters.
        let mut counts: HashMap<ClientId, u32> = HashMap::new();
        for (owner, n) in held {
            let client = fast
                .owners
                .get(&owner)
                .and_then(|t| self.conns.get(t))
                .and_then(|c| c.client);
            if let Some(client) = client {
                counts.insert(client, n);
            }
        }
        let mut changes: Vec<(ClientId, u32)> = fast
            .told_held
            .keys()
            .filter(|c| !counts.contains_key(c))
            .map(|&c| (c, 0))
            .collect();
        changes.extend(
            counts
                .iter()
                .filter(|(c, n)| fast.told_held.get(c) != Some(n))
                .map(|(&c, &n)| (c, n)),
        );
        fast.told_held = counts;
        let client = fast.client;
        for (c, n) in changes {
            self.pool.set_table_held(c, n, now);
        }
        for _ in 0..returned {
            let _ = self.pool.release(client, now);
        }
        self.apply_effects();
        self.fast_queue_moved(moved);
        for token in cut {
            if let Some(fast) = self.fast.as_mut() {
                fast.cut_off += 1;
            }
            self.close(
                token,
                Some("holds a shared table word the broker never lent; cut off".into()),
            );
        }
    }

    /// A client of the table gave back while it was closed.
    pub(super) fn fast_returned(&mut self) {
        if let Some(fast) = self.fast.as_mut() {
            fast.dirty = true;
        }
    }

    /// The connection of owner `owner` in the table is closing (the
    /// broker closes it at its stop when `at_stop`): free what it held
    /// there. Returns the words freed.
    pub(super) fn fast_forget(
        &mut self,
        owner: u32,
        id: Option<ClientId>,
        at_stop: bool,
        shut: bool,
    ) -> u32 {
        let Some(fast) = self.fast.as_mut() else {
            return 0;
        };
        fast.owners.remove(&owner);
        if let Some(id) = id {
            fast.forget_name(id);
        }
        // The slot first: a giver that has not yet woken it fails to, and
        // one that has, has written its gift, which the reading below
        // finds.
        fast.table.clear_slot(owner, shut);
        if shut {
            fast.shut.insert(owner);
        }
        let mut freed = 0;
        for i in 0..fast.table.words() {
            if !fast.lent[i as usize] {
                continue;
            }
            let v = fast.table.word(i).load(std::sync::atomic::Ordering::SeqCst);
            match as_gift(v) {
                Some((_, h)) if h == owner => {
                    if fast.table.reclaim(i, v) {
                        freed += 1;
                    }
                }
                Some((g, _)) if g == owner => {}
                _ => {
                    if fast.table.reclaim(i, owner) {
                        freed += 1;
                    }
                }
            }
        }
        fast.table
            .set_hi(fast.owners.keys().copied().max().unwrap_or(0));
        // What it was handing on when it died.
        let (moved, _freed) = fast.table.finish_giver(owner);
        fast.finished_givers.insert(owner);
        if at_stop {
            fast.held_at_shutdown += u64::from(freed);
        } else {
            fast.reclaimed += u64::from(freed);
        }
        fast.dirty = true;
        self.fast_queue_moved(moved);
        freed
    }

    /// Tokens held from the table (as its words say) that the broker counts
    /// in use, and the table's peak, bounded by the pool.
    pub(super) fn fast_note_in_use(&mut self, broker_in_use: u32) {
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        let delta = i64::from(broker_in_use) - i64::from(fast.base_in_use);
        if delta != 0 {
            fast.table.add_in_use(delta);
            fast.base_in_use = broker_in_use;
        }
    }
}

impl Broker {
    /// A socket client asks for a token while the pool has none free but
    /// the table has: take the table's free words back first, so the ask
    /// is answered as if they had never left (a `TryAcquire` is granted,
    /// an `Acquire` does not queue), and queue the clients waiting in the
    /// table ahead of it. The table reopens after the event if it may.
    pub(super) fn fast_take_back_for_socket(&mut self) {
        let Some(fast) = self.fast.as_ref() else {
            return;
        };
        if self.pool.free() > 0 || self.pool.waiting() > 0 {
            return;
        }
        if fast.lent() == 0 && fast.table.waiters().is_empty() {
            return;
        }
        fast.table.close_gate();
        // Clients waiting in the table asked first: they queue first.
        self.fast_move_waiters();
        self.fast_sweep(true);
    }
}

impl Broker {
    /// The classic bridge's next offer is due. It is asked for in the
    /// pool's queue, ahead of the waits in the table, which stay there
    /// (the table half-opens, so that the next token given back reaches
    /// the broker, and the broker serves them itself while the offer is
    /// out: `fast_may_serve`). A free word, when the table has one, is
    /// taken back for it at once, without closing the table first: a take
    /// and the taking back are each one compare-and-swap of that word.
    pub(super) fn fast_ask_for_offer(&mut self) {
        if self.pool.free() > 0 {
            return;
        }
        let words = self.fast.as_ref().map_or(0, |f| f.table.words());
        let _ = (0..words).any(|i| self.fast_take_back_word(i));
    }

    /// Takes lent word `i` back into the pool if it is free (one
    /// compare-and-swap, whatever the gate says): whether it was.
    fn fast_take_back_word(&mut self, i: u32) -> bool {
        let Some(fast) = self.fast.as_mut() else {
            return false;
        };
        if !fast.lent[i as usize] || !fast.table.take_back(i) {
            return false;
        }
        fast.lent[i as usize] = false;
        fast.lent_count -= 1;
        let (client, now) = (fast.client, self.now());
        let _ = self.pool.release(client, now);
        self.apply_effects();
        true
    }
}

impl Broker {
    /// Clients holding a word of the table that wait neither in it nor at
    /// the broker: a release of theirs is still to come (for the classic
    /// bridge's liveness rule).
    pub(super) fn fast_holders_not_waiting(&self) -> usize {
        let Some(fast) = self.fast.as_ref() else {
            return 0;
        };
        let mut holders = std::collections::HashSet::new();
        for i in 0..fast.table.words() {
            if !fast.lent[i as usize] {
                continue;
            }
            let v = fast.table.word(i).load(std::sync::atomic::Ordering::SeqCst);
            let k = as_gift(v).map_or(v, |(_, h)| h);
            if fast.table.is_waiting(k) {
                continue;
            }
            let client = fast
                .owners
                .get(&k)
                .and_then(|t| self.conns.get(t))
                .and_then(|c| c.client);
            if client.is_some_and(|c| self.pool.pending(c) == 0) {
                holders.insert(k);
            }
        }
        holders.len()
    }

    /// Words of the table each client holds, as the words say now.
    pub(super) fn fast_held_by_client(&self) -> HashMap<ClientId, u32> {
        let mut held = HashMap::new();
        let Some(fast) = self.fast.as_ref() else {
            return held;
        };
        for i in 0..fast.table.words() {
            if !fast.lent[i as usize] {
                continue;
            }
            let v = fast.table.word(i).load(std::sync::atomic::Ordering::SeqCst);
            let v = as_gift(v).map_or(v, |(_, h)| h);
            let client = fast
                .owners
                .get(&v)
                .and_then(|t| self.conns.get(t))
                .and_then(|c| c.client);
            if let Some(client) = client {
                *held.entry(client).or_insert(0) += 1;
            }
        }
        held
    }
}

impl Broker {
    /// Closes the table at once (an abort, a stop): no take succeeds from
    /// the next instruction on; the next balance takes free words back.
    pub(super) fn fast_close(&mut self) {
        if let Some(fast) = self.fast.as_mut() {
            fast.table.close_gate();
            fast.dirty = true;
        }
        // After the gate: no giver hands a word to a waiter from now on,
        // and every waiter hears of the close (and the abort or stop that
        // follows) from the socket.
        self.fast_move_waiters();
    }
}
