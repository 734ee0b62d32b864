//! Token accounting: a pure, I/O-free state machine.
//!
//! The [`Pool`] knows every client, every token each one holds, and every
//! waiter in arrival order. The broker feeds it events (connect, acquire,
//! release, disconnect, abort) together with the current time, and carries
//! out the [`Effect`]s it returns: a grant becomes one write to one client.
//! Nothing here reads a clock or touches a file descriptor, so every
//! invariant of ARCHITECTURE §4 is checked by property tests (see the tests at the
//! bottom of this file).
//!
//! # Tokens
//!
//! - **Pool tokens**: the shared `capacity` (N − 1 for `-jN`, the N-th being
//!   the implicit token of the command at the top of the tree).
//! - **Slots**: every job runner (the command at the top, each job that runs
//!   jobs of its own, each make recipe) owns one implicit token, which never
//!   goes to the broker. The broker keeps one slot per runner, named by
//!   a [`SlotKey`] that is handed down to the runner's subtree, never
//!   guessed from process ids. A client that names a slot when it connects
//!   (what `herdless exec` does) may run in it when nobody else holds it:
//!   the slot is lent to at most one borrower at a time, however many
//!   processes lie between the runner and its jobs. Slots are counted apart
//!   from the pool, so nested jobs progress with zero spare tokens.
//!
//! # Stopping
//!
//! [`Pool::stop`] ends the pool's service: every waiter is told
//! ([`Effect::Stopped`]) and no token is granted after it, so closing the
//! connections one by one cannot hand a freed token to the next waiter.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::Duration;

use crate::protocol::AbortReason;
use crate::stats::Histogram;

mod controls;
pub use controls::Cap;

/// A client's identity inside the pool; never reused during a pool's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientId(pub u64);

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The name of a slot: the implicit token of one job runner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SlotKey {
    /// A slot the broker minted for a job runner (the command of `run`, of
    /// `serve`'s shell, of each `exec`), named by an unguessable id that the
    /// runner's subtree inherits in `HERDLESS_SLOT`.
    Minted(u64),
    /// The slot of a make recipe, named by the process id of the recipe's
    /// root (the process its make started); made when the first of its
    /// jobs connects, gone when the last one leaves.
    Recipe(u32),
}

impl fmt::Display for SlotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotKey::Minted(id) => write!(f, "slot {id:016x}"),
            SlotKey::Recipe(pid) => write!(f, "recipe slot of pid {pid}"),
        }
    }
}

/// What a client says about itself when it connects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientInfo {
    /// Process id of the client (from the kernel where it offers one).
    pub pid: u32,
    /// The slot this client may borrow: the implicit token of the job runner
    /// it is a job of. `None` for a client that is no one's job.
    pub borrows: Option<SlotKey>,
    /// The client only asks for status; it never holds or waits for tokens.
    pub observer: bool,
    /// A short label for status output (`"native"`, `"classic"`).
    pub label: &'static str,
    /// The broker's own client (the classic bridge): its waits stay out of
    /// the wait-time figures, which describe native clients.
    pub internal: bool,
}

/// Where a granted token comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// One of the shared tokens.
    Pool,
    /// The implicit token of the slot the client borrows.
    Slot,
}

/// What the broker must do after a call into the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Send one grant to `client`. `waited` is true when the client had been
    /// queued (it is woken by this grant), false for an immediate answer.
    Grant {
        /// Who gets the token.
        client: ClientId,
        /// Which kind of token it is.
        source: Source,
        /// Whether the client had been waiting for it.
        waited: bool,
    },
    /// Answer a try-acquire: no token is free.
    Denied {
        /// Who asked.
        client: ClientId,
    },
    /// Answer a cancel: whether a pending acquire was withdrawn.
    Cancelled {
        /// Who asked.
        client: ClientId,
        /// Whether an acquire was pending.
        cancelled: bool,
    },
    /// Answer a cancel nobody waits for, which found no pending acquire:
    /// the token of the grant that raced it was taken back from `client`
    /// ([`Pool::cancel_or_take_back`]).
    TakenBack {
        /// Who asked.
        client: ClientId,
    },
    /// `client` holds its slot `key` now, in place of one of its shared
    /// tokens, which went back to the pool ([`Pool::swap_into_slot`]):
    /// as many tokens held as before, nothing to tell it.
    Swapped {
        /// Who holds the slot.
        client: ClientId,
        /// The slot.
        key: SlotKey,
    },
    /// Tell `client` that the tree is aborting.
    Aborted {
        /// Who is told.
        client: ClientId,
        /// Why the tree aborts.
        reason: AbortReason,
    },
    /// Tell `client`, which waits or asks for a token, that the pool has
    /// stopped: no token will come.
    Stopped {
        /// Who is told.
        client: ClientId,
    },
}

/// A misuse of the pool by a client; the broker closes that connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The client id is not (or no longer) connected.
    #[error("client {0} is not connected")]
    UnknownClient(ClientId),
    /// A release with nothing held.
    #[error("client {0} released a token it does not hold")]
    NotHolding(ClientId),
    /// An observer asked for a token.
    #[error("client {0} is an observer and cannot take tokens")]
    Observer(ClientId),
}

#[derive(Clone, Debug)]
struct ClientState {
    info: ClientInfo,
    pool_held: u32,
    slot_held: bool,
    waiting: u32,
    /// Slots minted for this client's own job (its command's subtree).
    owns: Vec<SlotKey>,
    /// Tokens it holds from the shared table, as the broker last read them
    /// (`Pool::set_table_held`): the table's client holds them in these
    /// books, but a cap counts them as this client's.
    table_held: u32,
}

/// One job runner's implicit token.
#[derive(Clone, Debug)]
struct Slot {
    /// The client whose job this slot is (an `exec`); `None` for the
    /// command at the top and for make recipes.
    owner: Option<ClientId>,
    /// The one client the slot is lent to, if any.
    borrower: Option<ClientId>,
    /// Lending it puts one more token to work: true for the top's implicit
    /// token (the N-th), false for a slot whose runner already runs on a
    /// token counted elsewhere (an `exec`'s, a recipe's).
    counts: bool,
    /// Connected clients that name this slot.
    users: u32,
    /// Removed once nobody names it any more (recipe slots).
    ephemeral: bool,
    /// Its owner left: removed once its borrower gives it back.
    orphaned: bool,
}

impl Slot {
    fn removable(&self) -> bool {
        self.borrower.is_none() && (self.orphaned || (self.ephemeral && self.users == 0))
    }
}

#[derive(Clone, Copy, Debug)]
struct Waiter {
    client: ClientId,
    since: Duration,
}

/// Statistics kept by the pool; times are those the broker passed in.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Tokens granted (pool and slots).
    pub grants: u64,
    /// Grants answered at once, without waiting.
    pub immediate: u64,
    /// Grants that woke a waiting client: one message to one process each.
    pub wakeups: u64,
    /// Grants that lent a slot.
    pub slot_grants: u64,
    /// Try-acquires answered "no token free".
    pub denied: u64,
    /// Pending acquires withdrawn by their client.
    pub cancelled: u64,
    /// Tokens taken back for a withdrawal that came after its grant was
    /// sent ([`Pool::cancel_or_take_back`]).
    pub raced_grants: u64,
    /// Tokens taken back from clients that disconnected holding them.
    pub reclaimed: u64,
    /// Acquires refused because the pool had stopped (the waiters told at
    /// the stop, and those that asked after it).
    pub refused_after_stop: u64,
    /// Tokens still held by clients when the pool's owner closed them at
    /// shutdown (not counted as reclaimed: those clients did not die).
    pub held_at_shutdown: u64,
    /// Clients that connected.
    pub connections: u64,
    /// The most tokens (pool and the top's implicit token) in use at once.
    pub max_in_use: u32,
    /// How long granted waiters waited, in nanoseconds.
    pub wait_ns: Histogram,
}

/// One client's holdings, for status output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The client.
    pub client: ClientId,
    /// Its process id.
    pub pid: u32,
    /// Its label (`native`, `classic`).
    pub label: &'static str,
    /// Tokens it holds, a borrowed slot included.
    pub held: u32,
    /// Acquires it has waiting.
    pub waiting: u32,
}

/// The token pool. See the module documentation.
#[derive(Debug)]
pub struct Pool {
    capacity: u32,
    free: u32,
    clients: BTreeMap<ClientId, ClientState>,
    /// The clients holding or waiting for a token, so that what only
    /// they matter for (a status document, the accounting check) costs
    /// them, not a walk over every idle client.
    busy: BTreeSet<ClientId>,
    /// Connected observers.
    observers: usize,
    queue: VecDeque<Waiter>,
    slots: HashMap<SlotKey, Slot>,
    /// Slots lent now whose token counts (see [`Pool::slots_in_use`]),
    /// kept so that the figure costs nothing however many slots exist.
    counted_lent: usize,
    /// The slots whose token counts (the top command's), which a cap may
    /// withhold: few, so that a release under a cap need not walk them all.
    counting: BTreeSet<SlotKey>,
    /// Connections of clients other than the broker's own (the classic
    /// bridge, the shared table), ever.
    external_connections: u64,
    aborted: Option<AbortReason>,
    stopped: bool,
    next_id: u64,
    stats: Stats,
    effects: Vec<Effect>,
    controls: controls::Controls,
}

impl Pool {
    /// A pool of `capacity` shared tokens, all free.
    pub fn new(capacity: u32) -> Pool {
        Pool {
            capacity,
            free: capacity,
            clients: BTreeMap::new(),
            busy: BTreeSet::new(),
            observers: 0,
            queue: VecDeque::new(),
            slots: HashMap::new(),
            counted_lent: 0,
            counting: BTreeSet::new(),
            external_connections: 0,
            aborted: None,
            stopped: false,
            next_id: 1,
            stats: Stats::default(),
            effects: Vec::new(),
            controls: controls::Controls::default(),
        }
    }

    /// The number of shared tokens.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Shared tokens not held by anyone.
    pub fn free(&self) -> u32 {
        self.free
    }

    /// Acquires waiting in the queue.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Acquires waiting in the queue, other than `except`'s, that a free
    /// shared token would go to now: those that no cap and no admission
    /// limit holds back.
    pub fn waiting_grantable(&self, except: Option<ClientId>) -> usize {
        let others = self
            .queue
            .iter()
            .filter(|w| Some(w.client) != except)
            .map(|w| w.client);
        if !self.has_caps() {
            // Admission holds back every client alike, `except` too.
            return others.count();
        }
        self.count_may_take_shared(others)
    }

    /// Slots lent now whose token counts as one more in use (the top's
    /// implicit token).
    pub fn slots_in_use(&self) -> usize {
        self.counted_lent
    }

    /// Slots the pool knows, lent or not.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Whether a slot of this key exists.
    pub fn has_slot(&self, key: SlotKey) -> bool {
        self.slots.contains_key(&key)
    }

    /// The abort posted to the tree, if any.
    pub fn aborted(&self) -> Option<AbortReason> {
        self.aborted
    }

    /// Whether [`Pool::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Clients that ever connected, not counting the broker's own (the
    /// classic bridge's, the shared table's).
    pub fn external_connections(&self) -> u64 {
        self.external_connections
    }

    /// Statistics so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Shared tokens held by `client`, plus one if it holds a slot.
    pub fn held_by(&self, client: ClientId) -> Option<u32> {
        self.clients
            .get(&client)
            .map(|c| c.pool_held + u32::from(c.slot_held))
    }

    /// Acquires `client` has waiting in the queue.
    pub fn pending(&self, client: ClientId) -> u32 {
        self.clients.get(&client).map_or(0, |c| c.waiting)
    }

    /// Whether nothing but FIFO order would decide who gets a free shared
    /// token now, and the pool is in service: nobody waits, no cap, no
    /// admission limit holding, no shrink under way, no abort, no stop.
    /// Only then does the broker lend free tokens to the shared table
    /// (`crate::fast`), which hands them out first come, first served.
    pub fn plain(&self) -> bool {
        self.queue.is_empty() && self.plain_but_queue()
    }

    /// [`plain`](Self::plain) but for the waiters in the queue: once they
    /// are served, FIFO order alone would decide again.
    pub fn plain_but_queue(&self) -> bool {
        self.unrestricted() && self.retiring() == 0 && self.aborted.is_none() && !self.stopped
    }

    /// Records that `id` holds `n` tokens from the shared table (held, in
    /// these books, by the table's client): caps count them as `id`'s. A
    /// lower figure may let a waiter held back by a cap take a free token.
    pub fn set_table_held(&mut self, id: ClientId, n: u32, now: Duration) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        let lower = n < c.table_held;
        c.table_held = n;
        if lower {
            self.dispatch_pool(now);
        }
    }

    /// Whether slot `key` exists and is lent to nobody.
    pub fn slot_lendable(&self, key: SlotKey) -> bool {
        self.slots.get(&key).is_some_and(|s| s.borrower.is_none())
    }

    /// Whether `client` would be lent its slot now.
    pub fn slot_free_for(&self, client: ClientId) -> bool {
        self.clients
            .get(&client)
            .is_some_and(|_| self.may_borrow(client))
    }

    /// Whether `id` would be lent its slot now: the slot is free and, if
    /// it is the top command's (a token of its own, the N-th of `-jN`), no
    /// cap over `id` is reached. A slot lent by a job is that job's own
    /// token, never withheld (a job of a job must not deadlock).
    fn may_borrow(&self, id: ClientId) -> bool {
        let Some(c) = self.clients.get(&id) else {
            return false;
        };
        if c.slot_held {
            return false;
        }
        c.info
            .borrows
            .and_then(|k| self.slots.get(&k))
            .is_some_and(|s| s.borrower.is_none() && (!s.counts || self.caps_allow_slot(id)))
    }

    /// Clients other than `except` that hold shared tokens and are not
    /// waiting for more: the ones that can still give a token back without
    /// first being granted another.
    pub fn holders_not_waiting(&self, except: ClientId) -> usize {
        self.busy
            .iter()
            .filter(|&&id| id != except)
            .filter_map(|id| self.clients.get(id))
            .filter(|c| c.pool_held > 0 && c.waiting == 0)
            .count()
    }

    /// Shared tokens that are neither free nor held by a connected client.
    /// Zero unless the pool's own accounting is broken: a pool on its own
    /// cannot lose a token, because a closed connection returns all of its.
    pub fn unaccounted(&self) -> i64 {
        let held: u64 = self
            .busy
            .iter()
            .filter_map(|id| self.clients.get(id))
            .map(|c| u64::from(c.pool_held))
            .sum();
        i64::from(self.capacity) + i64::from(self.retiring()) - i64::from(self.free) - held as i64
    }

    /// Every non-observer client's holdings, in connection order.
    pub fn holdings(&self) -> Vec<Holding> {
        self.clients
            .iter()
            .filter(|(_, c)| !c.info.observer)
            .map(|(&id, c)| Self::holding(id, c))
            .collect()
    }

    /// The holdings a status document chooses from, and the number of
    /// non-observer clients: every client that holds or waits for a token,
    /// then the `idle` oldest of the others (the only idle ones a listing
    /// of the busiest, then the oldest, can show), in connection order.
    /// Costs the busy clients and `idle` others, however many are idle.
    pub fn holdings_for_status(&self, idle: usize) -> (Vec<Holding>, usize) {
        let mut out: Vec<Holding> = self
            .busy
            .iter()
            .filter_map(|&id| Some(Self::holding(id, self.clients.get(&id)?)))
            .collect();
        out.extend(
            self.clients
                .iter()
                .filter(|(id, c)| !c.info.observer && !self.busy.contains(id))
                .take(idle)
                .map(|(&id, c)| Self::holding(id, c)),
        );
        out.sort_unstable_by_key(|h| h.client);
        (out, self.clients.len() - self.observers)
    }

    /// One client's holding, if it is connected.
    pub fn holding_of(&self, id: ClientId) -> Option<Holding> {
        self.clients.get(&id).map(|c| Self::holding(id, c))
    }

    fn holding(id: ClientId, c: &ClientState) -> Holding {
        Holding {
            client: id,
            pid: c.info.pid,
            label: c.info.label,
            held: c.pool_held + u32::from(c.slot_held),
            waiting: c.waiting,
        }
    }

    /// Files `id` among the busy clients or not, after its holdings or
    /// waits changed.
    fn refile(&mut self, id: ClientId) {
        match self.clients.get(&id) {
            Some(c) if c.pool_held > 0 || c.slot_held || c.waiting > 0 => {
                self.busy.insert(id);
            }
            _ => {
                self.busy.remove(&id);
            }
        }
    }

    /// Takes the effects produced since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Adds a slot: the implicit token of a job runner. `owner` is the
    /// client whose job the runner is (its slot goes when it does); `None`
    /// for the command at the top, whose token is the N-th of `-jN` and so
    /// `counts` as one more token in use when lent. Returns false, changing
    /// nothing, when the key is taken or the owner is not connected.
    pub fn add_slot(&mut self, key: SlotKey, owner: Option<ClientId>, counts: bool) -> bool {
        if self.slots.contains_key(&key) {
            return false;
        }
        if let Some(owner) = owner {
            let Some(c) = self.clients.get_mut(&owner) else {
                return false;
            };
            c.owns.push(key);
        }
        if counts {
            self.counting.insert(key);
        }
        self.slots.insert(
            key,
            Slot {
                owner,
                borrower: None,
                counts,
                users: 0,
                ephemeral: false,
                orphaned: false,
            },
        );
        true
    }

    /// Registers a client. A recipe slot it names is made if it is new; a
    /// minted slot it names must exist (otherwise the client borrows none).
    /// If the tree has already aborted or the pool stopped, the client is
    /// told at once.
    pub fn connect(&mut self, mut info: ClientInfo) -> ClientId {
        let id = ClientId(self.next_id);
        self.next_id += 1;
        self.stats.connections += 1;
        if !info.internal {
            self.external_connections += 1;
        }
        if info.observer {
            info.borrows = None;
        }
        match info.borrows {
            Some(key @ SlotKey::Recipe(_)) => {
                let slot = self.slots.entry(key).or_insert(Slot {
                    owner: None,
                    borrower: None,
                    counts: false,
                    users: 0,
                    ephemeral: true,
                    orphaned: false,
                });
                slot.users += 1;
            }
            Some(key @ SlotKey::Minted(_)) => match self.slots.get_mut(&key) {
                Some(slot) if !slot.orphaned => slot.users += 1,
                _ => info.borrows = None,
            },
            None => {}
        }
        let observer = info.observer;
        self.observers += usize::from(observer);
        self.clients.insert(
            id,
            ClientState {
                info,
                pool_held: 0,
                slot_held: false,
                waiting: 0,
                owns: Vec::new(),
                table_held: 0,
            },
        );
        if let (Some(reason), false) = (self.aborted, observer) {
            self.effects.push(Effect::Aborted { client: id, reason });
        }
        id
    }

    /// The slot a client names, if it exists.
    pub fn borrows(&self, id: ClientId) -> Option<SlotKey> {
        self.clients.get(&id).and_then(|c| c.info.borrows)
    }

    /// Asks for one token: granted at once when one is free, otherwise the
    /// client waits in FIFO order. After an abort the answer is `Aborted`,
    /// after a stop `Stopped`.
    pub fn acquire(&mut self, id: ClientId, now: Duration) -> Result<(), PoolError> {
        self.check_taker(id)?;
        if self.refuse(id) {
            return Ok(());
        }
        if !self.grant_now(id) {
            self.client_mut(id)?.waiting += 1;
            self.queue.push_back(Waiter {
                client: id,
                since: now,
            });
            self.refile(id);
        }
        Ok(())
    }

    /// Asks for one token without waiting: a grant or a denial.
    pub fn try_acquire(&mut self, id: ClientId) -> Result<(), PoolError> {
        self.check_taker(id)?;
        if self.refuse(id) {
            return Ok(());
        }
        if !self.grant_now(id) {
            self.stats.denied += 1;
            self.effects.push(Effect::Denied { client: id });
        }
        Ok(())
    }

    /// After an abort or a stop, answers an acquire at once.
    fn refuse(&mut self, id: ClientId) -> bool {
        if let Some(reason) = self.aborted {
            self.effects.push(Effect::Aborted { client: id, reason });
            return true;
        }
        if self.stopped {
            self.stats.refused_after_stop += 1;
            self.effects.push(Effect::Stopped { client: id });
            return true;
        }
        false
    }

    /// Withdraws the client's most recent pending acquire, if it has one.
    pub fn cancel(&mut self, id: ClientId) -> Result<(), PoolError> {
        let client = self.client_mut(id)?;
        let cancelled = client.waiting > 0;
        if cancelled {
            client.waiting -= 1;
            let pos = self
                .queue
                .iter()
                .rposition(|w| w.client == id)
                .expect("a waiting client is in the queue");
            self.queue.remove(pos);
            self.stats.cancelled += 1;
            self.refile(id);
        }
        self.effects.push(Effect::Cancelled {
            client: id,
            cancelled,
        });
        Ok(())
    }

    /// Withdraws one pending acquire of the client, as [`Pool::cancel`]; when
    /// none is pending, the grant that answered it has been sent already,
    /// and the client, which does not wait for this answer, had not read
    /// it when it asked: that token is taken back as if the client gave
    /// it back (it goes to the first waiter), and the answer says so
    /// ([`Effect::TakenBack`]). Nothing is taken back after an abort or a
    /// stop (the acquire was answered by those), nor from a client that
    /// holds nothing.
    pub fn cancel_or_take_back(&mut self, id: ClientId, now: Duration) -> Result<(), PoolError> {
        let client = self.client_mut(id)?;
        let holds = client.pool_held > 0 || client.slot_held;
        if client.waiting > 0 || !holds || self.aborted.is_some() || self.stopped {
            return self.cancel(id);
        }
        self.release(id, now)?;
        self.stats.raced_grants += 1;
        self.effects.push(Effect::TakenBack { client: id });
        Ok(())
    }

    /// Gives back one token held by the client: a shared token if it holds
    /// one, otherwise its slot. The token goes to the first waiter that may
    /// take it.
    pub fn release(&mut self, id: ClientId, now: Duration) -> Result<(), PoolError> {
        let client = self.client_mut(id)?;
        if client.pool_held > 0 {
            client.pool_held -= 1;
            if !self.retire_returned() {
                self.free += 1;
            }
            self.dispatch_pool(now);
        } else if client.slot_held {
            client.slot_held = false;
            let key = client.info.borrows.expect("a slot holder names its slot");
            self.give_back_slot(key, now);
            // A cap counts slots: one given back may let a capped waiter
            // take a free shared token.
            self.dispatch_pool(now);
        } else {
            return Err(PoolError::NotHolding(id));
        }
        self.refile(id);
        Ok(())
    }

    /// The borrower of `key` gave it back (or left): lend it to the next
    /// waiter that names it, or remove it if it is done with.
    fn give_back_slot(&mut self, key: SlotKey, now: Duration) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        if slot.counts && slot.borrower.is_some() {
            self.counted_lent -= 1;
        }
        slot.borrower = None;
        if slot.removable() {
            self.slots.remove(&key);
            self.counting.remove(&key);
        } else {
            self.dispatch_slot(key, now);
        }
    }

    /// Removes a client however its connection ended: its pending acquires
    /// are dropped and every token it held returns to the pool. Returns the
    /// number of tokens reclaimed (counted in [`Stats::reclaimed`]).
    pub fn disconnect(&mut self, id: ClientId, now: Duration) -> u32 {
        let reclaimed = self.remove_client(id, now);
        self.stats.reclaimed += u64::from(reclaimed);
        reclaimed
    }

    /// Removes a client that the pool's owner closes at shutdown, after
    /// [`Pool::stop`]: like [`Pool::disconnect`], but the tokens it held
    /// count as held at shutdown, not as taken back from a dead client.
    pub fn close_at_shutdown(&mut self, id: ClientId, now: Duration) -> u32 {
        let held = self.remove_client(id, now);
        self.stats.held_at_shutdown += u64::from(held);
        held
    }

    /// Removes a client whose tokens the pool's owner counts as lost at
    /// shutdown (the classic side's, which never came back): they leave
    /// the pool's books without also counting as taken back or held.
    pub fn close_lost(&mut self, id: ClientId, now: Duration) -> u32 {
        self.remove_client(id, now)
    }

    fn remove_client(&mut self, id: ClientId, now: Duration) -> u32 {
        let Some(client) = self.clients.remove(&id) else {
            return 0;
        };
        self.busy.remove(&id);
        self.observers -= usize::from(client.info.observer);
        if client.waiting > 0 {
            self.queue.retain(|w| w.client != id);
            // Give back the memory of a queue one client had flooded.
            if self.queue.capacity() > 1024 && self.queue.len() < self.queue.capacity() / 4 {
                self.queue.shrink_to_fit();
            }
        }
        self.forget_controls_of(id);
        let mut reclaimed = client.pool_held;
        for _ in 0..client.pool_held {
            if !self.retire_returned() {
                self.free += 1;
            }
        }
        // Its own job's slots go with it; one still lent goes when it is
        // given back.
        for key in &client.owns {
            if let Some(slot) = self.slots.get_mut(key) {
                slot.orphaned = true;
                if slot.removable() {
                    self.slots.remove(key);
                    self.counting.remove(key);
                }
            }
        }
        if let Some(key) = client.info.borrows {
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.users = slot.users.saturating_sub(1);
            }
            if client.slot_held {
                reclaimed += 1;
                self.give_back_slot(key, now);
            } else if self.slots.get(&key).is_some_and(Slot::removable) {
                self.slots.remove(&key);
                self.counting.remove(&key);
            }
        }
        self.dispatch_pool(now);
        reclaimed
    }

    /// Posts an abort to the whole tree. The first reason wins; every
    /// client is told, pending acquires end, and no token is granted after
    /// it. Returns false when the tree had already aborted.
    pub fn abort(&mut self, reason: AbortReason) -> bool {
        if self.aborted.is_some() {
            return false;
        }
        self.aborted = Some(reason);
        self.queue.clear();
        for (&client, state) in self.clients.iter_mut() {
            state.waiting = 0;
            if !state.info.observer {
                self.effects.push(Effect::Aborted { client, reason });
            }
        }
        let clients = &self.clients;
        self.busy.retain(|id| {
            clients
                .get(id)
                .is_some_and(|c| c.pool_held > 0 || c.slot_held)
        });
        true
    }

    /// Stops the pool: every waiting client is told (one `Stopped` each),
    /// the queue empties, and no token is granted from now on; later
    /// acquires are answered `Stopped`. Releases and disconnects still
    /// count, so the statistics stay true. Returns false when already
    /// stopped.
    pub fn stop(&mut self) -> bool {
        if self.stopped {
            return false;
        }
        self.stopped = true;
        let mut told = Vec::new();
        for w in self.queue.drain(..) {
            if !told.contains(&w.client) {
                told.push(w.client);
            }
        }
        for client in told {
            if let Some(c) = self.clients.get_mut(&client) {
                self.stats.refused_after_stop += u64::from(c.waiting);
                c.waiting = 0;
            }
            self.refile(client);
            self.effects.push(Effect::Stopped { client });
        }
        true
    }

    fn check_taker(&self, id: ClientId) -> Result<(), PoolError> {
        match self.clients.get(&id) {
            None => Err(PoolError::UnknownClient(id)),
            Some(c) if c.info.observer => Err(PoolError::Observer(id)),
            Some(_) => Ok(()),
        }
    }

    fn client_mut(&mut self, id: ClientId) -> Result<&mut ClientState, PoolError> {
        self.clients
            .get_mut(&id)
            .ok_or(PoolError::UnknownClient(id))
    }

    /// Grants at once if the client's slot or a shared token is free (and
    /// no earlier waiter is owed the shared token).
    fn grant_now(&mut self, id: ClientId) -> bool {
        if self.may_borrow(id) {
            self.give(id, Source::Slot, false);
            return true;
        }
        // A free shared token with a waiter queued that may take it cannot
        // happen (the no-idle-while-free invariant); check anyway so FIFO
        // order is kept even if it ever did. Waiters held back by a cap or
        // by admission do not keep a client that may take it from a token.
        if self.free > 0 && self.may_take_shared(id) && self.first_eligible().is_none() {
            self.give(id, Source::Pool, false);
            return true;
        }
        false
    }

    fn give(&mut self, id: ClientId, source: Source, waited: bool) {
        let client = self.clients.get_mut(&id).expect("client exists");
        match source {
            Source::Pool => {
                self.free -= 1;
                client.pool_held += 1;
            }
            Source::Slot => {
                client.slot_held = true;
                let key = client.info.borrows.expect("a borrower names its slot");
                let slot = self.slots.get_mut(&key).expect("a lent slot exists");
                if slot.counts && slot.borrower.is_none() {
                    self.counted_lent += 1;
                }
                slot.borrower = Some(id);
                self.stats.slot_grants += 1;
            }
        }
        self.stats.grants += 1;
        if waited {
            self.stats.wakeups += 1;
        } else {
            self.stats.immediate += 1;
        }
        self.busy.insert(id);
        let in_use = self.shared_in_use() + self.slots_in_use() as u32;
        self.stats.max_in_use = self.stats.max_in_use.max(in_use);
        self.effects.push(Effect::Grant {
            client: id,
            source,
            waited,
        });
    }

    fn dequeue_at(&mut self, pos: usize, now: Duration) -> ClientId {
        let waiter = self.queue.remove(pos).expect("position is in the queue");
        let client = self.clients.get_mut(&waiter.client).expect("waiter exists");
        client.waiting -= 1;
        // Busy still unless this was its last wait and it holds nothing;
        // the grant that follows files it again.
        let idle = client.waiting == 0 && client.pool_held == 0 && !client.slot_held;
        if idle {
            self.busy.remove(&waiter.client);
        }
        if !client.info.internal {
            let waited = now.saturating_sub(waiter.since);
            self.stats
                .wait_ns
                .record(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
        }
        waiter.client
    }

    fn dispatch_pool(&mut self, now: Duration) {
        if self.aborted.is_some() || self.stopped {
            return;
        }
        while self.free > 0 {
            let Some(pos) = self.first_eligible() else {
                break;
            };
            let id = self.dequeue_at(pos, now);
            self.give(id, Source::Pool, true);
        }
        // A cap may have held a waiter back from the top slot; whatever
        // let a shared token go may let it go too.
        if self.has_caps() {
            let counting: Vec<SlotKey> = self.counting.iter().copied().collect();
            for key in counting {
                self.dispatch_slot(key, now);
            }
        }
    }

    fn dispatch_slot(&mut self, key: SlotKey, now: Duration) {
        if self.aborted.is_some() || self.stopped {
            return;
        }
        if !self.slots.get(&key).is_some_and(|s| s.borrower.is_none()) {
            return;
        }
        let pos = self.queue.iter().position(|w| {
            self.clients[&w.client].info.borrows == Some(key) && self.may_borrow(w.client)
        });
        if let Some(pos) = pos {
            let id = self.dequeue_at(pos, now);
            self.give(id, Source::Slot, true);
            return;
        }
        self.swap_into_slot(key, now);
    }

    /// Slot `key` is free and nobody waits for it: a client that names it
    /// and holds a shared token in its place (a make started beside the
    /// slot's borrower by one recipe, which took a shared token as its
    /// share of the recipe's) holds the slot instead, and the shared token
    /// goes to the next waiter. It holds as many tokens as before; without
    /// this, a make that waits for more in the shared table, where slots
    /// are not lent, never got the slot, and the pool ran one short.
    fn swap_into_slot(&mut self, key: SlotKey, now: Duration) {
        if !self.slots.get(&key).is_some_and(|s| s.users > 0) {
            return;
        }
        // A client holding a shared token is busy.
        let Some(id) = self.busy.iter().copied().find(|&id| {
            self.clients
                .get(&id)
                .is_some_and(|c| c.info.borrows == Some(key) && c.pool_held > 0 && !c.slot_held)
                && self.may_borrow(id)
        }) else {
            return;
        };
        let client = self.clients.get_mut(&id).expect("client exists");
        client.pool_held -= 1;
        client.slot_held = true;
        let slot = self.slots.get_mut(&key).expect("a lent slot exists");
        if slot.counts {
            self.counted_lent += 1;
        }
        slot.borrower = Some(id);
        self.effects.push(Effect::Swapped { client: id, key });
        if !self.retire_returned() {
            self.free += 1;
        }
        self.dispatch_pool(now);
    }

    /// Checks the invariants that hold after every call; used by tests and
    /// by debug builds of the broker.
    pub fn check_invariants(&self) -> Result<(), String> {
        // 1. Conservation of shared tokens.
        let held: u64 = self.clients.values().map(|c| u64::from(c.pool_held)).sum();
        let retiring = self.retiring();
        if u64::from(self.free) + held != u64::from(self.capacity) + u64::from(retiring) {
            return Err(format!(
                "conservation: free {} + held {held} != capacity {} + retiring {retiring}",
                self.free, self.capacity
            ));
        }
        if retiring > 0 && self.free > 0 {
            return Err(format!(
                "{} tokens free while a shrink waits for {retiring}",
                self.free
            ));
        }
        // 3. No idle-while-free: no waiter that may take a shared token
        // (not held back by a cap or by admission) waits while one is free.
        if self.free > 0 && self.first_eligible().is_some() {
            return Err(format!(
                "{} waiters queued while {} tokens are free",
                self.queue.len(),
                self.free
            ));
        }
        for w in &self.queue {
            if self.may_borrow(w.client) {
                return Err(format!(
                    "{} waits while its {} is free",
                    w.client,
                    self.clients[&w.client]
                        .info
                        .borrows
                        .expect("a borrower names its slot")
                ));
            }
        }
        // The index of busy clients and the count of observers agree with
        // the clients.
        let busy: BTreeSet<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.pool_held > 0 || c.slot_held || c.waiting > 0)
            .map(|(&id, _)| id)
            .collect();
        if busy != self.busy {
            return Err(format!("busy clients {busy:?}, {:?} recorded", self.busy));
        }
        let observers = self.clients.values().filter(|c| c.info.observer).count();
        if observers != self.observers {
            return Err(format!(
                "{observers} observers, {} recorded",
                self.observers
            ));
        }
        // 5. One borrower per slot, and borrowers agree with the slots.
        let counted_lent = self
            .slots
            .values()
            .filter(|s| s.counts && s.borrower.is_some())
            .count();
        if counted_lent != self.counted_lent {
            return Err(format!(
                "{counted_lent} counted slots lent, {} recorded",
                self.counted_lent
            ));
        }
        let counting: BTreeSet<SlotKey> = self
            .slots
            .iter()
            .filter(|(_, s)| s.counts)
            .map(|(&k, _)| k)
            .collect();
        if counting != self.counting {
            return Err(format!(
                "counting slots {counting:?}, {:?} recorded",
                self.counting
            ));
        }
        for (key, slot) in &self.slots {
            if let Some(holder) = slot.borrower {
                let c = self
                    .clients
                    .get(&holder)
                    .ok_or_else(|| format!("{key} lent to a gone client"))?;
                if !c.slot_held || c.info.borrows != Some(*key) {
                    return Err(format!("{key} disagrees with its borrower {holder}"));
                }
            }
            if let Some(owner) = slot.owner {
                if !slot.orphaned && !self.clients.contains_key(&owner) {
                    return Err(format!("{key} outlived its owner {owner}"));
                }
            }
            if slot.removable() {
                return Err(format!("{key} should have been removed"));
            }
            let users = self
                .clients
                .values()
                .filter(|c| c.info.borrows == Some(*key))
                .count();
            if users != slot.users as usize {
                return Err(format!(
                    "{key} counts {} users, {users} name it",
                    slot.users
                ));
            }
        }
        for (id, c) in &self.clients {
            if c.slot_held {
                let key = c
                    .info
                    .borrows
                    .ok_or(format!("{id} holds a slot it never named"))?;
                if self.slots.get(&key).and_then(|s| s.borrower) != Some(*id) {
                    return Err(format!("{id} holds {key}, which is not lent to it"));
                }
            }
        }
        // Waiting counters agree with the queue.
        for (&id, c) in &self.clients {
            let queued = self.queue.iter().filter(|w| w.client == id).count();
            if queued != c.waiting as usize {
                return Err(format!(
                    "{id} counts {} waits, queue has {queued}",
                    c.waiting
                ));
            }
        }
        if self.aborted.is_some() && !self.queue.is_empty() {
            return Err("waiters queued after an abort".into());
        }
        // 10. A stop is a stop.
        if self.stopped && !self.queue.is_empty() {
            return Err("waiters queued after the stop".into());
        }
        Ok(())
    }
}

/// What the pool's tests and those of the pools built on it share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::time::Duration;

    use super::ClientInfo;

    /// `ms` milliseconds of the test's clock.
    pub(crate) fn t(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// A native client of process `pid`.
    pub(crate) fn native(pid: u32) -> ClientInfo {
        ClientInfo {
            pid,
            label: "native",
            ..ClientInfo::default()
        }
    }
}

#[cfg(test)]
mod tests;
