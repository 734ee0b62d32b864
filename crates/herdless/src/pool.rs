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
//!   the implicit token of the process at the top of the tree).
//! - **Parent slots**: every process owns one implicit token that never goes
//!   to the broker. A client that says it is a *job of its parent* (what
//!   `herdless exec` is) may run in its parent's implicit slot when no
//!   sibling holds it; slots are counted apart from the pool, one per parent
//!   process id, so nested jobs progress with zero spare tokens.

use std::collections::{BTreeMap, HashMap, VecDeque};
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

/// What a client says about itself when it connects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientInfo {
    /// Process id of the client (from the kernel where it offers one).
    pub pid: u32,
    /// Process id of the client's parent.
    pub ppid: u32,
    /// The client is a job of its parent process and may run in the
    /// parent's implicit slot.
    pub job_of_parent: bool,
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
    /// The implicit token of the client's parent process.
    ParentSlot,
}

/// What the broker must do after a call into the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Send one grant to `client`. `waited` is true when the client had been
    /// queued (it is woken by this grant), false for an immediate answer.
    Grant {
        /// Who gets the token.
        client: ClientId,
        /// Where the token comes from.
        source: Source,
        /// Whether the client had been queued.
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
        /// True when an acquire was waiting and is withdrawn; false when
        /// none was (its grant, if any, is already on its way).
        cancelled: bool,
    },
    /// Tell `client` that the tree is aborting.
    Aborted {
        /// Who is told.
        client: ClientId,
        /// Why the tree stops: an error or an interrupt.
        reason: AbortReason,
    },
}

/// A misuse of the pool by a client; the broker closes that connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The client is not (or no longer) connected.
    #[error("client {0} is not connected")]
    UnknownClient(ClientId),
    /// A release without a token held.
    #[error("client {0} released a token it does not hold")]
    NotHolding(ClientId),
    /// An acquire, try-acquire or release from a status-only client.
    #[error("client {0} is an observer and cannot take tokens")]
    Observer(ClientId),
}

#[derive(Clone, Debug)]
struct ClientState {
    info: ClientInfo,
    pool_held: u32,
    slot_held: bool,
    waiting: u32,
}

#[derive(Clone, Copy, Debug)]
struct Waiter {
    client: ClientId,
    since: Duration,
}

/// Statistics kept by the pool; times are those the broker passed in.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Tokens granted (pool and parent slots).
    pub grants: u64,
    /// Grants answered at once, without waiting.
    pub immediate: u64,
    /// Acquires that had to wait in the queue.
    pub waits: u64,
    /// Grants that woke a waiting client: one message to one process each.
    pub wakeups: u64,
    /// Grants that came from a parent's implicit slot.
    pub slot_grants: u64,
    /// Try-acquires answered "no token free".
    pub denied: u64,
    /// Pending acquires withdrawn by their client.
    pub cancelled: u64,
    /// Tokens taken back from clients that disconnected holding them.
    pub reclaimed: u64,
    /// Clients that connected.
    pub connections: u64,
    /// The most tokens (pool and parent slots) in use at once.
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
    /// Its kind, as `status` shows it.
    pub label: &'static str,
    /// Tokens it holds, a borrowed parent slot included.
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
    queue: VecDeque<Waiter>,
    slots: HashMap<u32, ClientId>,
    aborted: Option<AbortReason>,
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
            queue: VecDeque::new(),
            slots: HashMap::new(),
            aborted: None,
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

    /// Parent slots currently lent to a job.
    pub fn slots_in_use(&self) -> usize {
        self.slots.len()
    }

    /// The abort posted to the tree, if any.
    pub fn aborted(&self) -> Option<AbortReason> {
        self.aborted
    }

    /// Statistics so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Shared tokens held by `client`, plus one if it holds a parent slot.
    pub fn held_by(&self, client: ClientId) -> Option<u32> {
        self.clients
            .get(&client)
            .map(|c| c.pool_held + u32::from(c.slot_held))
    }

    /// Acquires `client` has waiting in the queue.
    pub fn pending(&self, client: ClientId) -> u32 {
        self.clients.get(&client).map_or(0, |c| c.waiting)
    }

    /// Whether `client` would be granted its parent's implicit slot now.
    pub fn slot_free_for(&self, client: ClientId) -> bool {
        self.clients.get(&client).is_some_and(|c| {
            c.info.job_of_parent && !c.slot_held && !self.slots.contains_key(&c.info.ppid)
        })
    }

    /// Clients other than `except` that hold shared tokens and are not
    /// waiting for more: the ones that can still give a token back without
    /// first being granted another.
    pub fn holders_not_waiting(&self, except: ClientId) -> usize {
        self.clients
            .iter()
            .filter(|(&id, c)| id != except && c.pool_held > 0 && c.waiting == 0)
            .count()
    }

    /// Shared tokens that are neither free nor held by a connected client.
    /// Zero unless the pool's own accounting is broken: a pool on its own
    /// cannot lose a token, because a closed connection returns all of its.
    pub fn unaccounted(&self) -> i64 {
        let held: u64 = self.clients.values().map(|c| u64::from(c.pool_held)).sum();
        i64::from(self.capacity) + i64::from(self.retiring()) - i64::from(self.free) - held as i64
    }

    /// Every non-observer client's holdings, in connection order.
    pub fn holdings(&self) -> Vec<Holding> {
        self.clients
            .iter()
            .filter(|(_, c)| !c.info.observer)
            .map(|(&id, c)| Holding {
                client: id,
                pid: c.info.pid,
                label: c.info.label,
                held: c.pool_held + u32::from(c.slot_held),
                waiting: c.waiting,
            })
            .collect()
    }

    /// Takes the effects produced since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Registers a client. If the tree has already aborted, the client is
    /// told at once.
    pub fn connect(&mut self, info: ClientInfo) -> ClientId {
        let id = ClientId(self.next_id);
        self.next_id += 1;
        self.stats.connections += 1;
        let observer = info.observer;
        self.clients.insert(
            id,
            ClientState {
                info,
                pool_held: 0,
                slot_held: false,
                waiting: 0,
            },
        );
        if let (Some(reason), false) = (self.aborted, observer) {
            self.effects.push(Effect::Aborted { client: id, reason });
        }
        id
    }

    /// Asks for one token: granted at once when one is free, otherwise the
    /// client waits in FIFO order. After an abort the answer is `Aborted`.
    pub fn acquire(&mut self, id: ClientId, now: Duration) -> Result<(), PoolError> {
        self.check_taker(id)?;
        if let Some(reason) = self.aborted {
            self.effects.push(Effect::Aborted { client: id, reason });
            return Ok(());
        }
        if !self.grant_now(id) {
            self.stats.waits += 1;
            self.client_mut(id)?.waiting += 1;
            self.queue.push_back(Waiter {
                client: id,
                since: now,
            });
        }
        Ok(())
    }

    /// Asks for one token without waiting: a grant or a denial.
    pub fn try_acquire(&mut self, id: ClientId) -> Result<(), PoolError> {
        self.check_taker(id)?;
        if let Some(reason) = self.aborted {
            self.effects.push(Effect::Aborted { client: id, reason });
            return Ok(());
        }
        if !self.grant_now(id) {
            self.stats.denied += 1;
            self.effects.push(Effect::Denied { client: id });
        }
        Ok(())
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
        }
        self.effects.push(Effect::Cancelled {
            client: id,
            cancelled,
        });
        Ok(())
    }

    /// Gives back one token held by the client: a shared token if it holds
    /// one, otherwise its parent slot. The token goes to the first waiter
    /// that may take it.
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
            let ppid = client.info.ppid;
            self.slots.remove(&ppid);
            self.dispatch_slot(ppid, now);
            // A cap counts parent slots: one given back may let a capped
            // waiter take a free shared token.
            self.dispatch_pool(now);
        } else {
            return Err(PoolError::NotHolding(id));
        }
        Ok(())
    }

    /// Removes a client however its connection ended: its pending acquires
    /// are dropped and every token it held returns to the pool. Returns the
    /// number of tokens reclaimed.
    pub fn disconnect(&mut self, id: ClientId, now: Duration) -> u32 {
        let Some(client) = self.clients.remove(&id) else {
            return 0;
        };
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
        if client.slot_held {
            reclaimed += 1;
            self.slots.remove(&client.info.ppid);
            self.dispatch_slot(client.info.ppid, now);
        }
        self.stats.reclaimed += u64::from(reclaimed);
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

    /// Grants at once if the client's parent slot or a shared token is free
    /// (and no earlier waiter is owed the shared token).
    fn grant_now(&mut self, id: ClientId) -> bool {
        let client = &self.clients[&id];
        let ppid = client.info.ppid;
        if client.info.job_of_parent && !client.slot_held && !self.slots.contains_key(&ppid) {
            self.give(id, Source::ParentSlot, false);
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
            Source::ParentSlot => {
                client.slot_held = true;
                self.slots.insert(client.info.ppid, id);
                self.stats.slot_grants += 1;
            }
        }
        self.stats.grants += 1;
        if waited {
            self.stats.wakeups += 1;
        } else {
            self.stats.immediate += 1;
        }
        let in_use = self.shared_in_use() + self.slots.len() as u32;
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
        if !client.info.internal {
            let waited = now.saturating_sub(waiter.since);
            self.stats
                .wait_ns
                .record(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
        }
        waiter.client
    }

    fn dispatch_pool(&mut self, now: Duration) {
        if self.aborted.is_some() {
            return;
        }
        while self.free > 0 {
            let Some(pos) = self.first_eligible() else {
                break;
            };
            let id = self.dequeue_at(pos, now);
            self.give(id, Source::Pool, true);
        }
    }

    fn dispatch_slot(&mut self, ppid: u32, now: Duration) {
        if self.aborted.is_some() || self.slots.contains_key(&ppid) {
            return;
        }
        let pos = self.queue.iter().position(|w| {
            let c = &self.clients[&w.client];
            c.info.job_of_parent && c.info.ppid == ppid && !c.slot_held
        });
        if let Some(pos) = pos {
            let id = self.dequeue_at(pos, now);
            self.give(id, Source::ParentSlot, true);
        }
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
            let c = &self.clients[&w.client];
            if c.info.job_of_parent && !c.slot_held && !self.slots.contains_key(&c.info.ppid) {
                return Err(format!(
                    "{} waits while its parent's slot {} is free",
                    w.client, c.info.ppid
                ));
            }
        }
        // 5. One job per parent slot, and slot holders agree with the map.
        for (&ppid, &holder) in &self.slots {
            let c = self
                .clients
                .get(&holder)
                .ok_or_else(|| format!("slot {ppid} held by a gone client"))?;
            if !c.slot_held || c.info.ppid != ppid {
                return Err(format!("slot {ppid} map disagrees with {holder}"));
            }
        }
        let slot_holders = self.clients.values().filter(|c| c.slot_held).count();
        if slot_holders != self.slots.len() {
            return Err("a client holds a slot the map does not know".into());
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
        Ok(())
    }
}

#[cfg(test)]
mod tests;
